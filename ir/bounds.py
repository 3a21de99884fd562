"""Data-dependent lengths: values whose extent along one axis is known only at run time.

NonZero, Compress, Unique and NonMaxSuppression produce as many elements as their input data
selects. Cortex gives such a value a static upper bound (`Value.shape`, what every buffer is sized
by) and marks the axis whose real extent is smaller (`Value.bound_axis`); the real length is one
int32, the value's *length companion*, which every value derived from the same selection shares
(`Value.length_key`). A bounded buffer is *padded*: the real tensor is its leading `length` slots
along the bounded axis and every other slot holds zeros, so an elementwise op, a Gather by such
indices or a Transpose computes the right result in the real slots without knowing the length.

Where a bounded tensor crosses a CU border it travels at its real shape: the producing device
slices its buffer to the length, the reading device pads it back into its own buffer and writes the
length into its companion. cu.onnx files spell the bounded dim as the symbol `bound_dim_param`
names, so onnxruntime runs them at any length and Cortex's importer reads the bound back.
"""

from __future__ import annotations

import re

import numpy as np

_BOUND_DIM = re.compile(r"^cortex_length_le_([0-9]+)_of_(.+)$", re.DOTALL)


def bound_dim_param(bound: int, key: str) -> str:
    """The symbolic dim a cu.onnx declares for a bounded axis of at most `bound` elements whose
    length is that of the selection `key`: values of one selection share one symbol, so a CU that
    reads two of them knows their lengths agree (and so does onnxruntime)."""
    return f"cortex_length_le_{int(bound)}_of_{key}"


def parse_bound_dim_param(dim) -> tuple[int, str] | None:
    """(bound, length key) of a `bound_dim_param` symbol; None for any other dim."""
    found = _BOUND_DIM.match(dim) if isinstance(dim, str) else None
    return (int(found.group(1)), found.group(2)) if found else None


def length_name(tensor: str) -> str:
    """The name a CU's artifacts give the length companion of a bounded input or output."""
    return f"{tensor}#length"


def real_part(padded: np.ndarray, axis: int, length: int) -> np.ndarray:
    """The real tensor inside a padded buffer: its first `length` slots along `axis` (a view)."""
    if not 0 <= length <= padded.shape[axis]:
        raise ValueError(f"a length of {length} lies outside the bound {padded.shape[axis]}")
    return padded[(slice(None),) * axis + (slice(0, length),)]


def pad_into(padded: np.ndarray, real: np.ndarray, axis: int) -> int:
    """Write `real` into the padded buffer `padded` (zeros elsewhere); returns its length. Every
    other dim must agree and the length must fit the bound."""
    real = np.asarray(real)
    expected = tuple(d for k, d in enumerate(padded.shape) if k != axis)
    got = tuple(d for k, d in enumerate(real.shape) if k != axis)
    if real.ndim != padded.ndim or got != expected or real.shape[axis] > padded.shape[axis]:
        raise ValueError(f"shape {list(real.shape)} does not fit {list(padded.shape)} bounded along axis {axis}")
    padded[...] = 0
    padded[(slice(None),) * axis + (slice(0, real.shape[axis]),)] = real
    return int(real.shape[axis])
