"""A narrow constant B (ir/loops/narrow_weights.py) in the GEMM's 16-column panels, for the kernels
that widen it as they read it (kernels/gemv.py, kernels/microkernel.py).

- bf16: panels `[ceil(N/16)][K][16]` of the bfloat16 bits (32 bytes a k step), the last panel
  zero-padded: half the bytes of `gemm.pack_b`'s float32 panels.
- int8: panels `[ceil(N/16)][K][16]` of the int8 codes (16 bytes a k step), then the per-column
  scales as float32, `16 ceil(N/16)` of them (the padding's 1): a quarter of the bytes, plus N floats.

`narrow_panel_bytes(format)` is the bytes of one k step of one panel; `packed_narrow_size(format, k, n)`
the whole packed constant's. `widened_b(format, word, index)` is the WAT of one v128 of float32
columns (4 `index` .. 4 `index` + 3 of the panel) from the 16 bytes `word` of the k step that
holds them, `b_word_offset(format, index)` where that word starts in the step. int8 widens with one
single-input byte shuffle (one `pshufb`), an arithmetic shift and a conversion per vector: the GEMM's
tiles (512^3, wasmtime, relaxed SIMD, GFLOP/s, float32 B in the same run 46-48) ran 34 with the
i8 -> i16 -> i32 extends, 36 with `i8x16.swizzle` into zeroed lanes, 31 with a two-input shuffle
against zero, 35-37 with a shuffle and a mask (the 2^24 folded into the scale), 38-39 with this.
"""

from __future__ import annotations

import numpy as np

from ir.loops.narrow_weights import NarrowWeight

PANEL = 16          # columns per panel, as the float32 panels (gemm.pack_b)
ELEMENT_BYTES = {"f32": 4, "bf16": 2, "int8": 1}
ZERO = "(v128.const i32x4 0 0 0 0)"
# Bytes 2i, 2i+1 of a zero vector, then of the bf16 bits, per lane: each bf16 as the high half of its
# float32, which is its exact value (one punpcklwd / punpckhwd on x86).
BF16_LOW = "0 1 16 17 2 3 18 19 4 5 20 21 6 7 22 23"
BF16_HIGH = "8 9 24 25 10 11 26 27 12 13 28 29 14 15 30 31"


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


def b_word_offset(format: str, index: int) -> int:
    """Where in one k step of a panel the 16 bytes holding vector `index` (0..3) start."""
    return 16 * (index * ELEMENT_BYTES[format] // 4)


def widened_b(format: str, word: str, index: int, zero: str = ZERO) -> str:
    """Vector `index` of a panel's k step as float32 (int8: the codes, unscaled), from `word`, the
    16 bytes at `b_word_offset(format, index)`; `zero`: a zero vector (bf16's low halves)."""
    if format == "f32":
        return word
    if format == "bf16":
        return f"(i8x16.shuffle {BF16_HIGH if index % 2 else BF16_LOW} {zero} {word})"
    if format == "int8":    # each lane's code copied into its top byte, then shifted down with its sign
        lanes = " ".join(str(4 * index + lane) for lane in range(4) for _ in range(4))
        return f"(f32x4.convert_i32x4_s (i32x4.shr_s (i8x16.shuffle {lanes} {word} {word}) (i32.const 24)))"
    raise ValueError(f"unknown B format {format!r}")
