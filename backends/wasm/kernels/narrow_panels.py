"""A narrow constant B (ir/loops/narrow_weights.py) in the GEMM's 16-column panels, for the kernels
that widen it as they read it (kernels/gemv.py in registers; backends/wasm/gemm.py one panel's K
block at a time into float32 scratch, `render_widened_block`).

- bf16, fp16: panels `[ceil(N/16)][K][16]` of the 16-bit patterns (32 bytes a k step), the last
  panel zero-padded: half the bytes of `gemm.pack_b`'s float32 panels.
- int8: panels `[ceil(N/16)][K][16]` of the int8 codes (16 bytes a k step), then the per-column
  scales as float32, `16 ceil(N/16)` of them (the padding's 1): a quarter of the bytes, plus N floats.

`narrow_panel_bytes(format)` is the bytes of one k step of one panel; `packed_narrow_size(format, k, n)`
the whole packed constant's.

Widening, exact for every value a kernel is given: a bf16 pattern is the top half of its float32 (one
byte shuffle with zeros). SIMD128 has no float16 conversion, so an fp16 pattern, placed in the top
half by the same shuffle, is shifted right by 3 with its sign: exponent and mantissa land where a
float32's are, with the exponent 112 short (the biases are 15 and 127), the sign stays at bit 31 and
clearing its 3 copies below gives the float32 2^-112 times the half's value; times 2^112 is exact,
for subnormal halves too (they come out of the shift as float32 subnormals, which WebAssembly
keeps). A half of exponent 31 would come out finite: Inf and NaN constants are never read narrow
(ir/loops/narrow_weights.py). Three integer ops and a multiply a vector, where bf16 takes none.

Why the GEMM widens a block into scratch rather than each B vector in its tiles' registers: the
tiles reuse each panel's K block for every row tile, so a block widened once serves them all, and
the tiles keep their float32 loop (kernels/microkernel.py). Measured (wasmtime 50, relaxed SIMD,
CPU time, best of 10 calls, 2 interleaved rounds, GFLOP/s; float32 B in the same run 45-48), bf16
in registers (the GEMV's shuffle) -> in scratch: 512^3 43.0-43.8 -> 46.7-48.3, 128x384x1536
43.9-44.4 -> 47.1-48.9, 128x1536x384 44.6-45.4 -> 47.3-48.4, 32x384x1536 44.1-45.0 -> 47.8,
16x384x384 42.6-42.7 -> 42.2-42.3. int8 in registers ran 34 at 512^3 (i8 -> i16 -> i32 extends;
31-38 with other shuffles and swizzles), in scratch 46-48; at 16x384x384 40 (85-88% of float32).
"""

from __future__ import annotations

import numpy as np

from backends.wasm.kernels.microkernel import PANEL, PANEL_BYTES
from ir.loops.narrow_weights import NarrowWeight

ELEMENT_BYTES = {"f32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def narrow_panel_bytes(format: str) -> int:
    return PANEL * ELEMENT_BYTES[format]


def packed_narrow_size(format: str, k: int, n: int) -> int:
    panels = -(-n // PANEL)
    return panels * k * narrow_panel_bytes(format) + (panels * PANEL * 4 if format == "int8" else 0)


def pack_narrow_b(weight: NarrowWeight, trans_b: bool = False) -> np.ndarray:
    """`weight`'s codes (K x N; N x K with trans_b) as panels, with the int8 scales after them; bytes."""
    codes = np.asarray(weight.codes)
    bits = codes.view(np.uint8) if weight.format == "int8" else codes.view(np.uint16)
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


# Bytes 2i, 2i+1 of a zero vector, then of the 16-bit patterns, per lane: each pattern as the high half
# of a lane, which is a bf16's float32 (one punpcklwd / punpckhwd on x86).
BF16_LOW = "0 1 16 17 2 3 18 19 4 5 20 21 6 7 22 23"
BF16_HIGH = "8 9 24 25 10 11 26 27 12 13 28 29 14 15 30 31"
ZERO = "(v128.const i32x4 0 0 0 0)"
FP16_SIGN_EXPONENT_MANTISSA = "(v128.const i32x4 0x8fffe000 0x8fffe000 0x8fffe000 0x8fffe000)"
TWO_TO_112 = "(v128.const i32x4 0x77800000 0x77800000 0x77800000 0x77800000)"


def fp16_widened(top_halves: str) -> str:
    """A v128 expression: the float32 values of the four fp16 patterns in the top halves of
    `top_halves`' lanes (a shuffle's output, as for bf16); see the module docstring."""
    return f"(f32x4.mul (v128.and (i32x4.shr_s {top_halves} (i32.const 3)) {FP16_SIGN_EXPONENT_MANTISSA}) {TWO_TO_112})"


def widened_16_bits(format: str, low_words: str, high_words: str) -> list[str]:
    """Four v128 expressions: the 16 bf16 or fp16 patterns of `low_words` then `high_words` (two
    v128 expressions of 8 patterns each) as float32, in column order."""
    vectors = [f"(i8x16.shuffle {lanes} {ZERO} {words})"
               for words in (low_words, high_words) for lanes in (BF16_LOW, BF16_HIGH)]
    return vectors if format == "bf16" else [fp16_widened(v) for v in vectors]


WIDENING_LOCALS = ("(local $wsrc i32) (local $wdst i32) (local $wend i32) (local $w0 v128) (local $w1 v128) "
                   "(local $ws0 v128) (local $ws1 v128) (local $ws2 v128) (local $ws3 v128)")


def render_widened_block(format: str, src: str, dst: int, steps: str, scales: str | None = None) -> list[str]:
    """WAT lines: `steps` (an i32 expression, at least 1) k steps of one panel stored `format`, from
    `src` (an i32 expression), as float32 panel rows [steps][16] at `dst`; int8 codes times their
    columns' scales (16 float32s at `scales`, an i32 expression), the values Cast + Mul give B.
    The function must declare WIDENING_LOCALS."""
    if format in ("bf16", "fp16"):
        words = ["(local.set $w0 (v128.load (local.get $wsrc)))", "(local.set $w1 (v128.load offset=16 (local.get $wsrc)))"]
        vectors = widened_16_bits(format, "(local.get $w0)", "(local.get $w1)")
        setup = []
    elif format == "int8":
        # each lane's code copied into its top byte (one pshufb), then shifted down with its sign
        words = ["(local.set $w0 (v128.load (local.get $wsrc)))"]
        vectors = []
        for v in range(4):
            lanes = " ".join(str(4 * v + lane) for lane in range(4) for _ in range(4))
            codes = f"(i32x4.shr_s (i8x16.shuffle {lanes} (local.get $w0) (local.get $w0)) (i32.const 24))"
            vectors.append(f"(f32x4.mul (f32x4.convert_i32x4_s {codes}) (local.get $ws{v}))")
        setup = [f"(local.set $ws{v} (v128.load offset={16 * v} {scales}))" for v in range(4)]
    else:
        raise ValueError(f"no widening of a {format!r} B")
    return [*setup,
            f"(local.set $wsrc {src})",
            f"(local.set $wdst (i32.const {dst}))",
            f"(local.set $wend (i32.add (i32.const {dst}) (i32.mul {steps} (i32.const {PANEL_BYTES}))))",
            "(loop $widen",
            *("  " + w for w in words),
            *(f"  (v128.store offset={16 * v} (local.get $wdst) {vector})" for v, vector in enumerate(vectors)),
            f"  (local.set $wsrc (i32.add (local.get $wsrc) (i32.const {narrow_panel_bytes(format)})))",
            f"  (local.set $wdst (i32.add (local.get $wdst) (i32.const {PANEL_BYTES})))",
            "  (br_if $widen (i32.lt_u (local.get $wdst) (local.get $wend))))"]
