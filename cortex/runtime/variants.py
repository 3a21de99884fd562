"""Reduced-precision variants at run time: which one a CU runs under a policy, and the guards.

A CU's variants (`cus[i].variants`, built by `compile-<target> --variants`) hold its weights in
float16, bfloat16 or int8, or (`tf32`, CUDA only) keep them float32 and run the CU's large
contractions on tf32 tensor cores. Under a policy with a `trust_threshold`, a CU runs its most
compact variant (fewest artifact bytes for the device's target, ties broken by the precision's
name) whose calibrated `trust` is at least the threshold; a variant whose trust is null was never
calibrated and never runs, whatever the policy. A tf32 variant holds the exact CU's bytes, so it
runs only where no narrower variant passes.

Guards (on unless the policy turns them off): every output of an approximated CU is checked
  - for NaN and Inf, unless the exact CU itself produced them during calibration, and
  - against the range the exact CU's output covered during calibration, widened by a margin of
    `GUARD_SPAN_MARGIN` of that range's span plus `GUARD_MAGNITUDE_MARGIN` of its largest
    magnitude on each side (the second term keeps a constant output's empty span from flagging
    the variant's own rounding).
A violation reruns the exact CU on the same inputs; its outputs are what the run uses, and the
trace lists the CU in `fell_back_cus` with the reason. A CU that never ran during calibration has
no range: only the NaN / Inf check applies to it.

The trace entries (`approximated_cus`, `fell_back_cus`) have the shape docs/runtime.md gives.
"""

from __future__ import annotations

import numpy as np

from backends.registry import Device
from cortex.dag import variant_id
from cortex.runtime.policy import Policy

GUARD_SPAN_MARGIN = 0.25
GUARD_MAGNITUDE_MARGIN = 0.01


def variant_record(cu: dict, precision: str) -> dict:
    """The CU record a device loads and runs for one variant: the CU's interface, the variant's
    artifacts (whose sha256 the device checks like any other)."""
    return {**cu, "id": variant_id(cu["id"], precision), "artifacts": cu["variants"][precision]["artifacts"]}


# Artifacts within this share of the most compact one's bytes count as equally compact: bf16 and fp16
# store the same weight bytes and their modules differ only by code (a bf16 product may run a larger,
# faster kernel), while int8's take fewer (half as many, or three quarters where the integer kernels
# keep them as 16-bit panels).
EQUALLY_COMPACT = 0.25
# Of equally compact variants, the one whose weights widen to float32 most cheaply: a bf16 value is the
# top half of a float32 (one shuffle in the kernel), an fp16 one three integer ops and a multiply more
# (SIMD128 has no conversion), and subnormal halves cost the CPU an assist.
WIDENING_ORDER = ("int8", "bf16", "fp16")


def chosen_variant(cu: dict, artifact: str | None, threshold: float | None) -> str | None:
    """The most compact calibrated variant with trust >= threshold that the device can run; of
    equally compact ones (`EQUALLY_COMPACT`), the cheapest to widen (`WIDENING_ORDER`), then the
    first by name (so a tf32 variant comes after a narrow one)."""
    if threshold is None or artifact is None:
        return None
    candidates = []
    for precision, variant in cu.get("variants", {}).items():
        trust, record = variant.get("trust"), variant.get("artifacts", {}).get(artifact)
        if trust is not None and trust >= threshold and record is not None:
            candidates.append((_stored_bytes(record), precision))
    if not candidates:
        return None
    smallest = min(size for size, _ in candidates)
    compact = [p for size, p in candidates if size <= smallest * (1 + EQUALLY_COMPACT)]
    rank = {p: i for i, p in enumerate(WIDENING_ORDER)}
    return min(compact, key=lambda p: (rank.get(p, len(rank)), p))


def _stored_bytes(record: dict) -> int:
    """How compact a variant's artifact is: a wasm module's bytes; a CUDA CU's weights file (its
    code, PTX and cubins, barely differ between precisions)."""
    if "bytes" in record:
        return int(record["bytes"])
    return int(record.get("weights", {}).get("bytes", 0))


def guard_violation(cu: dict, outputs: dict[str, np.ndarray]) -> str | None:
    """Why an approximated CU's outputs cannot be used, in a few words; None: they pass."""
    ranges = cu.get("calibration", {}).get("outputs", {})
    for name, array in outputs.items():
        observed = ranges.get(name, {})
        if array.size == 0 or not np.issubdtype(array.dtype, np.number):
            continue
        floating = np.issubdtype(array.dtype, np.floating)
        if floating and not observed.get("nonfinite") and not np.isfinite(array).all():
            return f"{name} holds NaN or Inf"
        lo, hi = observed.get("min"), observed.get("max")
        if lo is None or hi is None:
            continue
        margin = GUARD_SPAN_MARGIN * (hi - lo) + GUARD_MAGNITUDE_MARGIN * max(abs(lo), abs(hi))
        finite = array[np.isfinite(array)] if floating else array
        if finite.size and (float(finite.min()) < lo - margin or float(finite.max()) > hi + margin):
            return (f"{name} spans [{float(finite.min()):.6g}, {float(finite.max()):.6g}], outside its calibrated "
                    f"range [{lo:.6g}, {hi:.6g}] with margin {margin:.3g}")
    return None


class VariantRunner:
    """Runs one CU on its device as the policy allows: a variant (guarded) or the exact CU.

    `devices` by name and `placement` (CU id -> device name) are the scheduler's; `artifacts`
    gives each device's artifact key (None for devices that run cu.onnx files, which have no
    variants). Variants are loaded on first use, so a per-call policy can pick ones the model's
    policy did not."""

    def __init__(self, cus: dict[str, dict], placement: dict[str, str], devices: dict[str, Device],
                 artifacts: dict[str, str | None]):
        self.cus, self.placement, self.devices, self.artifacts = cus, placement, devices, artifacts
        self.loaded: set[str] = set()

    def choice(self, cu_id: str, policy: Policy) -> str | None:
        return chosen_variant(self.cus[cu_id], self.artifacts.get(self.placement[cu_id]), policy.trust_threshold)

    def load(self, policy: Policy) -> None:
        """The variants this policy picks, resident before the first request."""
        for cu_id in self.placement:
            precision = self.choice(cu_id, policy)
            if precision is not None:
                self._ensure_loaded(cu_id, precision)

    def prepare(self, cu_id: str, policy: Policy) -> None:
        """The variant the policy picks for this CU loaded now, so that `run` loads nothing."""
        precision = self.choice(cu_id, policy)
        if precision is not None:
            self._ensure_loaded(cu_id, precision)

    def run(self, cu: dict, inputs: dict, policy: Policy) -> tuple[dict, dict]:
        """The CU's outputs and what the trace says of it: {"precision", "trust"} when a variant's
        outputs were used, {"fell_back": reason} when a guard reran the exact CU, {} otherwise."""
        device = self.devices[self.placement[cu["id"]]]
        precision = self.choice(cu["id"], policy)
        if precision is None:
            return device.run(cu, inputs), {}
        self._ensure_loaded(cu["id"], precision)
        results = device.run(variant_record(cu, precision), inputs)
        trust = cu["variants"][precision]["trust"]
        if policy.guards:
            reason = guard_violation(cu, {name: device.to_host(t) for name, t in results.items()})
            if reason is not None:
                return device.run(cu, inputs), {"fell_back": f"guard on the {precision} variant: {reason}; "
                                                             "reran the exact CU"}
        return results, {"precision": precision, "trust": trust}

    def _ensure_loaded(self, cu_id: str, precision: str) -> None:
        key = variant_id(cu_id, precision)
        if key not in self.loaded:
            self.devices[self.placement[cu_id]].load([variant_record(self.cus[cu_id], precision)])
            self.loaded.add(key)


def variant_trace(entries: list[dict]) -> dict:
    """`approximated_cus` and `fell_back_cus` of one request, from the scheduler's per-CU entries."""
    return {
        "approximated_cus": [{"cu": e["cu"], "precision": e["precision"], "trust": e["trust"]}
                             for e in entries if "precision" in e],
        "fell_back_cus": [{"cu": e["cu"], "reason": e["fell_back"]} for e in entries if "fell_back" in e],
    }
