"""Accuracy metrics for outputs that may not match elementwise, and the gate on them
(`cortex verify --metric cosine:0.999,top1:0.95`).

A dynamically quantized model (onnxruntime's `quantize_dynamic`) quantizes activations at run
time: a last-bit difference in a float op before a DynamicQuantizeLinear moves a scale or flips a
code, and the later layers carry it. Its logits may then differ by far more than a float tolerance
while what the model decides is the same; the cosine similarity of an output with the reference
and the agreement of their top-1 along the last axis (a class, a token, a character per position)
say how much of the answer survived.
"""

from __future__ import annotations

import numpy as np

from ir.errors import CortexError

# Each metric's valid range, and the rule it is computed by.
METRICS = {"cosine": (-1.0, 1.0), "top1": (0.0, 1.0)}


def cosine_similarity(ours: np.ndarray, reference: np.ndarray) -> float | None:
    """Cosine of the angle between the two outputs flattened, on the elements both hold finite (an
    infinity or NaN on both sides is a masked score, not a direction). Two zero tensors are alike (1);
    one zero against another tensor is not (0). None: different shapes."""
    if ours.shape != reference.shape:
        return None
    a, b = ours.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
    finite = np.isfinite(a) & np.isfinite(b)
    a, b = a[finite], b[finite]
    norms = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    if norms == 0.0:
        return 1.0 if not np.any(a) and not np.any(b) else 0.0
    return float(np.clip(np.dot(a, b) / norms, -1.0, 1.0))


def top1_agreement(ours: np.ndarray, reference: np.ndarray) -> float | None:
    """The share of positions (every index but the last) whose argmax along the last axis is the
    same. None where there is no choice to agree on: a scalar, a last axis of one, other shapes."""
    if ours.shape != reference.shape or ours.ndim == 0 or ours.shape[-1] < 2 or ours.size == 0:
        return None
    return float(np.mean(np.argmax(ours, axis=-1) == np.argmax(reference, axis=-1)))


def relative_l2_error(ours: np.ndarray, reference: np.ndarray) -> float | None:
    """|ours - reference| / |reference| over the finite elements (None: other shapes)."""
    if ours.shape != reference.shape:
        return None
    a, b = ours.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
    finite = np.isfinite(a) & np.isfinite(b)
    diff, norm = float(np.linalg.norm(a[finite] - b[finite])), float(np.linalg.norm(b[finite]))
    return diff / norm if norm else (0.0 if diff == 0.0 else float("inf"))


def parse_metric_gate(text: str) -> dict[str, float]:
    """`cosine:0.999,top1:0.95` -> {"cosine": 0.999, "top1": 0.95}; a mistake is one CortexError."""
    gate: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition(":")
        if not sep or name not in METRICS:
            raise CortexError(f"--metric {text}: {part.strip()!r} is not NAME:MIN with NAME one of "
                              f"{', '.join(METRICS)} (e.g. cosine:0.999,top1:0.95)")
        if name in gate:
            raise CortexError(f"--metric {text}: {name} given twice")
        try:
            threshold = float(value)
        except ValueError:
            raise CortexError(f"--metric {text}: {name}'s minimum {value!r} is not a number") from None
        low, high = METRICS[name]
        if not low <= threshold <= high:      # also refuses NaN
            raise CortexError(f"--metric {text}: {name}'s minimum {value} is outside [{low:g}, {high:g}]")
        gate[name] = threshold
    return gate


def metric_failures(row: dict, gate: dict[str, float]) -> list[str]:
    """The gate's metrics this output row falls below, as `cosine 0.9991 < 0.9995`. A metric the
    output has no value for (top-1 of a scalar) is not gated; a shape or dtype mismatch fails all."""
    if row.get("why"):
        return [f"{name}: {row['why']}" for name in gate]
    return [f"{name} {row[name]:.8g} < {minimum:.10g}" for name, minimum in gate.items()
            if row.get(name) is not None and not row[name] >= minimum]
