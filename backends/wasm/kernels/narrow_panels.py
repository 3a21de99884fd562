"""A narrow constant B (ir/loops/narrow_weights.py) in the GEMM's 16-column panels, for the kernels
that widen it as they read it (kernels/gemv.py).

- bf16: panels `[ceil(N/16)][K][16]` of the bfloat16 bits (32 bytes a k step), the last panel
  zero-padded: half the bytes of `gemm.pack_b`'s float32 panels.
- int8: panels `[ceil(N/16)][K][16]` of the int8 codes (16 bytes a k step), then the per-column
  scales as float32, `16 ceil(N/16)` of them (the padding's 1): a quarter of the bytes, plus N floats.

`narrow_panel_bytes(format)` is the bytes of one k step of one panel; `packed_narrow_size(format, k, n)`
the whole packed constant's.
"""

from __future__ import annotations

import numpy as np

from backends.wasm.kernels.microkernel import PANEL
from ir.loops.narrow_weights import NarrowWeight

ELEMENT_BYTES = {"f32": 4, "bf16": 2, "int8": 1}


def narrow_panel_bytes(format: str) -> int:
    return PANEL * ELEMENT_BYTES[format]


def packed_narrow_size(format: str, k: int, n: int) -> int:
    panels = -(-n // PANEL)
    return panels * k * narrow_panel_bytes(format) + (panels * PANEL * 4 if format == "int8" else 0)


def pack_narrow_b(weight: NarrowWeight, trans_b: bool = False) -> np.ndarray:
    """`weight`'s codes (K x N; N x K with trans_b) as panels, with the int8 scales after them; bytes."""
    codes = np.asarray(weight.codes)
    bits = codes.view(np.uint16) if weight.format == "bf16" else codes.view(np.uint8)
    if trans_b:
        bits = bits.T
    k, n = bits.shape
    panels = -(-n // PANEL)
    padded = np.zeros((k, panels * PANEL), dtype=bits.dtype.newbyteorder("<"))
    padded[:, :n] = bits
    packed = padded.reshape(k, panels, PANEL).transpose(1, 0, 2).tobytes()
    if weight.format == "int8":
        scales = np.ones(panels * PANEL, dtype="<f4")
        scales[:n] = weight.column_scale
        packed += scales.tobytes()
    return np.frombuffer(packed, dtype=np.uint8)
