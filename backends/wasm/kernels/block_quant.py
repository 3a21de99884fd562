"""The SIMD128 kernel for a `BlockQuantGemmSpec` (MatMulNBits): 4- and 8-bit codes read as stored,
in both arithmetics the node's accuracy level asks for.

With int8 A (accuracy level 4), integer dot products per block, as onnxruntime's MLAS computes them
(CompInt8), in two phases in one call:
1. Each row of A is quantized per block of K into the scratch: scale max|a| / 127, codes
   round_half_even(a * (127 / max|a|)) (0 for an all-zero block, and for the padding past K), and
   the block's sum of codes.
2. Per row, per panel of 16 columns, per block: the integer sums sum_k qa * code of the 16 columns,
   then minus zero * sum(qa) (so the integer is sum_k qa * (code - zero), exactly onnxruntime's),
   converted to float32 and added to the column's total times scale_a * scale_b.

B (`pack_block_quant_b`) is one run of bytes per panel and block: the codes in chunks (8 k of a
4-bit block, 4 k of an 8-bit one), each chunk 4 vectors of 4 columns x 4 consecutive k (the 4-bit
codes of k+4..k+7 in the high nibbles), then the 16 columns' float32 scales, then their zero point
codes (with zero points). A vector of 4 columns x 4 k is what a dot product of 4 lanes reads against
4 codes of A splat over the lanes:
- `i16x8.relaxed_dot_i8x16_i7x16_s` under relaxed SIMD for 4-bit codes (0..15 are 7-bit, so the
  result is the same on every engine; a pair's sum, at most 2 x 127 x 15, fits 16 bits), then
  `i32x4.extadd_pairwise_i16x8_s`: 16 products in three instructions, as the accumulating
  `i32x4.relaxed_dot_i8x16_i7x16_add_s` lowers on x86 anyway (V8 11.3, Node 20's, computes that one
  wrong: twice the products, the accumulator dropped);
- `i32x4.dot_i16x8_s` otherwise (and for 8-bit codes, which are not 7-bit): the bytes widened to
  16 bits, each lane two products of one column, the pairs added at the block's end.

With float32 A (weight-only, levels 0 to 3), the first phase copies each row of A into the scratch
padded to whole blocks, with each block's sum; the second widens the codes of 4 columns at one k
into float32 lanes (one byte shuffle: the codes are small integers, converted exactly) and
multiplies-adds them with A[k] splat, then adds each block's sum_k a * code - zero * sum_k a, times
the scale, to the column's total. That is B's dequantized product up to float32 rounding (the
scale and zero point are applied per block, not per weight; the difference is of the order of
float32's epsilon times sum_k |a * w|), which is as close to onnxruntime's float32 kernels as their
own summation order lets any kernel be.

A 4-bit block of 32 then holds 16 x 16 bytes of codes, 64 of scales and 16 of zero points per panel:
5.25 bits a weight, 0.16 of float32's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.wasm.kernels.gemv import load_lanes, store_lanes
from ir.loops.contraction import BlockQuantGemmSpec, BlockQuantWeight

PANEL = 16
GROUPS = 4                      # vectors of 4 columns in a panel
KERNEL_BITS = (4, 8)


@dataclass(frozen=True)
class BlockQuantOffsets:
    """Byte offsets: A (float32 [m, k]), B (`pack_block_quant_b`), C (float32 [m, n]), the bias
    (n float32s) or None, and the scratch (`scratch_bytes`)."""
    a: int
    b: int
    c: int
    scratch: int
    bias: int | None = None


def block_quant_fits(spec: BlockQuantGemmSpec, features) -> bool:
    return "simd" in frozenset(features) and spec.bits in KERNEL_BITS and spec.block % 8 == 0


def _k_per_chunk(bits: int) -> int:
    return 8 if bits == 4 else 4


def block_bytes(spec: BlockQuantGemmSpec) -> int:
    """Bytes of one panel's block in B: codes, scales, zero points."""
    return PANEL * spec.block * spec.bits // 8 + PANEL * 4 + (PANEL if spec.zero_points else 0)


def packed_size(spec: BlockQuantGemmSpec) -> int:
    return -(-spec.n // PANEL) * -(-spec.k // spec.block) * block_bytes(spec)


def scratch_bytes(spec: BlockQuantGemmSpec) -> int:
    """A's codes (blocks x block bytes a row), then each row's block scales and block sums; with
    float32 A, A padded (blocks x block floats a row), then each row's block sums."""
    blocks = -(-spec.k // spec.block)
    if not spec.int8_a:
        return spec.m * blocks * spec.block * 4 + spec.m * blocks * 4
    return spec.m * blocks * spec.block + 2 * spec.m * blocks * 4


def pack_block_quant_b(spec: BlockQuantGemmSpec, weight: BlockQuantWeight) -> np.ndarray:
    """B's bytes in the layout the module docstring describes."""
    n, k, block = spec.n, spec.k, spec.block
    panels, blocks = -(-n // PANEL), -(-k // block)
    codes = np.zeros((panels * PANEL, blocks * block), np.uint8)
    codes[:n, :k] = weight.codes
    per_chunk = _k_per_chunk(spec.bits)
    chunks = block // per_chunk
    if spec.bits == 4:      # (p, g, i, b, c, half, j): k = b*block + c*8 + half*4 + j
        split = codes.reshape(panels, GROUPS, 4, blocks, chunks, 2, 4)
        chunked = split[..., 0, :] | (split[..., 1, :] << 4)
    else:                   # (p, g, i, b, c, j): k = b*block + c*4 + j
        chunked = codes.reshape(panels, GROUPS, 4, blocks, chunks, 4)
    parts = [chunked.transpose(0, 3, 4, 1, 2, 5).reshape(panels, blocks, -1)]
    scales = np.zeros((panels * PANEL, blocks), "<f4")
    scales[:n] = weight.scales
    parts.append(scales.reshape(panels, PANEL, blocks).transpose(0, 2, 1).copy().view(np.uint8))
    if spec.zero_points:
        zeros = np.zeros((panels * PANEL, blocks), np.uint8)
        zeros[:n] = weight.zeros
        parts.append(zeros.reshape(panels, PANEL, blocks).transpose(0, 2, 1))
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)


# A panel's block's 16 zero point codes (after its scales), widened to 16 bits in $zlo / $zhi;
# `zero_points_of(g)` is those of vector g's 4 columns as i32 lanes.
ZERO_POINTS_LOADED = ["(local.set $v (v128.load offset=64 (local.get $pb)))",
                      "(local.set $zlo (i16x8.extend_low_i8x16_u (local.get $v)))",
                      "(local.set $zhi (i16x8.extend_high_i8x16_u (local.get $v)))"]


def zero_points_of(g: int) -> str:
    return f"(i32x4.extend_{'low' if g % 2 == 0 else 'high'}_i16x8_u (local.get {'$zlo' if g < 2 else '$zhi'}))"


# i32 lanes 0, 2 (of the first operand), 0, 2 (of the second), and lanes 1, 3, 1, 3: the two halves
# of each column's pair sums in the 16-bit path
EVEN_LANES = "0 1 2 3 8 9 10 11 16 17 18 19 24 25 26 27"
ODD_LANES = "4 5 6 7 12 13 14 15 20 21 22 23 28 29 30 31"


def render_block_quant_gemm(spec: BlockQuantGemmSpec, at: BlockQuantOffsets, *, features, name: str) -> str:
    """`(func $name)`: C = A @ B (+ bias) as `BlockQuantGemmSpec` defines it."""
    features = frozenset(features)
    if not spec.int8_a:
        return _render_float_a(spec, at, features, name)
    m, n, k, bits, block = spec.m, spec.n, spec.k, spec.bits, spec.block
    blocks = -(-k // block)
    padded_k = blocks * block
    scales_at = at.scratch + m * padded_k            # each row's block scales, then block sums
    sums_at = scales_at + m * blocks * 4
    relaxed = "relaxed-simd" in features and bits == 4
    fma = "relaxed-simd" in features
    per_chunk = _k_per_chunk(bits)
    code_bytes = PANEL * block * bits // 8

    quantize = [
        "(local.set $r (i32.const 0))",
        "(loop $rows",
        f"  (local.set $blk (i32.const 0))",
        "  (loop $blocks",
        f"    (local.set $k0 (i32.mul (local.get $blk) (i32.const {block})))",
        f"    (local.set $kend (select (i32.add (local.get $k0) (i32.const {block})) (i32.const {k}) "
        f"(i32.lt_u (i32.add (local.get $k0) (i32.const {block})) (i32.const {k}))))",
        f"    (local.set $arow (i32.add (i32.const {at.a}) (i32.mul (local.get $r) (i32.const {k * 4}))))",
        "    (local.set $amax (f32.const 0))",
        "    (local.set $kk (local.get $k0))",
        "    (loop $max",
        "      (local.set $amax (f32.max (local.get $amax) (f32.abs (f32.load (i32.add (local.get $arow) "
        "(i32.shl (local.get $kk) (i32.const 2)))))))",
        "      (local.set $kk (i32.add (local.get $kk) (i32.const 1)))",
        "      (br_if $max (i32.lt_u (local.get $kk) (local.get $kend))))",
        f"    (local.set $slot (i32.add (i32.mul (local.get $r) (i32.const {blocks})) (local.get $blk)))",
        f"    (f32.store offset={scales_at} (i32.shl (local.get $slot) (i32.const 2)) "
        "(f32.div (local.get $amax) (f32.const 127)))",
        "    (local.set $inverse (select (f32.const 0) (f32.div (f32.const 127) (local.get $amax)) "
        "(f32.eq (local.get $amax) (f32.const 0))))",
        "    (local.set $sum (i32.const 0))",
        "    (local.set $kk (local.get $k0))",
        "    (loop $codes",
        "      (local.set $q (select (i32.trunc_sat_f32_s (f32.nearest (f32.mul (f32.load (i32.add (local.get $arow) "
        "(i32.shl (local.get $kk) (i32.const 2)))) (local.get $inverse)))) (i32.const 0) "
        "(i32.lt_u (local.get $kk) (local.get $kend))))",
        f"      (i32.store8 offset={at.scratch} (i32.add (i32.mul (local.get $r) (i32.const {padded_k})) (local.get $kk)) "
        "(local.get $q))",
        "      (local.set $sum (i32.add (local.get $sum) (local.get $q)))",
        "      (local.set $kk (i32.add (local.get $kk) (i32.const 1)))",
        f"      (br_if $codes (i32.lt_u (local.get $kk) (i32.add (local.get $k0) (i32.const {block})))))",
        f"    (i32.store offset={sums_at} (i32.shl (local.get $slot) (i32.const 2)) (local.get $sum))",
        "    (local.set $blk (i32.add (local.get $blk) (i32.const 1)))",
        f"    (br_if $blocks (i32.lt_u (local.get $blk) (i32.const {blocks}))))",
        "  (local.set $r (i32.add (local.get $r) (i32.const 1)))",
        f"  (br_if $rows (i32.lt_u (local.get $r) (i32.const {m}))))",
    ]

    accs = [f"$i{g}" for g in range(GROUPS)] if relaxed else [f"$i{g}{h}" for g in range(GROUPS) for h in "ab"]
    chunk: list[str] = []
    if relaxed:
        chunk += ["(local.set $alo (v128.load32_splat (local.get $pa)))",
                  "(local.set $ahi (v128.load32_splat offset=4 (local.get $pa)))"]
        for g in range(GROUPS):
            chunk += [f"(local.set $v (v128.load offset={16 * g} (local.get $pb)))",
                      f"(local.set $i{g} (i32x4.add (local.get $i{g}) (i32x4.extadd_pairwise_i16x8_s "
                      f"(i16x8.relaxed_dot_i8x16_i7x16_s (local.get $alo) "
                      f"(v128.and (local.get $v) (v128.const i8x16 {' '.join(['15'] * 16)}))))))",
                      f"(local.set $i{g} (i32x4.add (local.get $i{g}) (i32x4.extadd_pairwise_i16x8_s "
                      f"(i16x8.relaxed_dot_i8x16_i7x16_s (local.get $ahi) (i8x16.shr_u (local.get $v) (i32.const 4))))))"]
    else:
        chunk.append("(local.set $alo (i16x8.extend_low_i8x16_s (v128.load32_splat (local.get $pa))))")
        if bits == 4:
            chunk.append("(local.set $ahi (i16x8.extend_low_i8x16_s (v128.load32_splat offset=4 (local.get $pa))))")
        for g in range(GROUPS):
            chunk.append(f"(local.set $v (v128.load offset={16 * g} (local.get $pb)))")
            halves = [("(v128.and (local.get $v) (v128.const i8x16 " + " ".join(["15"] * 16) + "))", "$alo"),
                      ("(i8x16.shr_u (local.get $v) (i32.const 4))", "$ahi")] if bits == 4 else [("(local.get $v)", "$alo")]
            for codes, a in halves:
                chunk.append(f"(local.set $w {codes})")
                for h, part in (("a", "low"), ("b", "high")):
                    chunk.append(f"(local.set $i{g}{h} (i32x4.add (local.get $i{g}{h}) (i32x4.dot_i16x8_s "
                                 f"(i16x8.extend_{part}_i8x16_u (local.get $w)) (local.get {a}))))")
    chunk += [f"(local.set $pa (i32.add (local.get $pa) (i32.const {per_chunk})))",
              f"(local.set $pb (i32.add (local.get $pb) (i32.const {GROUPS * 16})))"]

    block_end = [f"(local.set $slot (i32.add (i32.mul (local.get $r) (i32.const {blocks})) (local.get $blk)))",
                 f"(local.set $sa (f32x4.splat (f32.load offset={scales_at} (i32.shl (local.get $slot) (i32.const 2)))))",
                 f"(local.set $sums (i32x4.splat (i32.load offset={sums_at} (i32.shl (local.get $slot) (i32.const 2)))))"]
    if spec.zero_points:
        block_end += ZERO_POINTS_LOADED
    for g in range(GROUPS):
        total = f"(local.get $i{g})" if relaxed else \
            (f"(i32x4.add (i8x16.shuffle {EVEN_LANES} (local.get $i{g}a) (local.get $i{g}b)) "
             f"(i8x16.shuffle {ODD_LANES} (local.get $i{g}a) (local.get $i{g}b)))")
        if spec.zero_points:
            correction = f"(i32x4.mul {zero_points_of(g)} (local.get $sums))"
        else:
            correction = f"(i32x4.shl (local.get $sums) (i32.const {bits - 1}))"
        scaled = f"(f32x4.mul (local.get $sa) (v128.load offset={16 * g} (local.get $pb)))"
        product = f"(f32x4.convert_i32x4_s (i32x4.sub {total} {correction}))"
        update = (f"(f32x4.relaxed_madd {product} {scaled} (local.get $t{g}))" if fma
                  else f"(f32x4.add (f32x4.mul {product} {scaled}) (local.get $t{g}))")
        block_end.append(f"(local.set $t{g} {update})")
    block_end.append(f"(local.set $pb (i32.add (local.get $pb) (i32.const {block_bytes(spec) - code_bytes})))")

    accumulators = [f"(local.set {x} (v128.const i32x4 0 0 0 0))" for x in accs]
    product = _rows_of_panels(spec, at, padded_k, accumulators, chunk, block_end)

    decls = ["(local $r i32) (local $blk i32) (local $k0 i32) (local $kend i32) (local $kk i32) (local $arow i32) "
             "(local $slot i32) (local $q i32) (local $sum i32) (local $p i32) (local $pa i32) (local $pb i32) "
             "(local $pend i32) (local $amax f32) (local $inverse f32)",
             "(local $v v128) (local $w v128) (local $alo v128) (local $ahi v128) (local $sa v128) (local $sums v128) "
             "(local $zlo v128) (local $zhi v128) " + " ".join(f"(local $t{g} v128)" for g in range(GROUPS)),
             " ".join(f"(local {x} v128)" for x in accs)]
    title = (f";; C[{m}x{n}] = A[{m}x{k}] @ B ({bits}-bit blocks of {block}{', zero points' if spec.zero_points else ''})"
             f"{' + bias' if at.bias is not None else ''}, A quantized to int8 per block; "
             f"{'relaxed dot' if relaxed else '16-bit dot'}")
    return "\n".join([f"(func ${name}", "  " + title, *("  " + d for d in decls),
                      *("  " + line for line in quantize + product), ")"]) + "\n"


def _rows_of_panels(spec: BlockQuantGemmSpec, at: BlockQuantOffsets, row_bytes: int, accumulators: list[str],
                    chunk: list[str], block_end: list[str]) -> list[str]:
    """The product's loops, shared by both arithmetics: rows $r, panels $p (the last one short when N
    is not a multiple of 16), blocks $blk, chunks; `accumulators` zero a block's sums, `chunk` adds
    one chunk to them (moving $pa through the row's `row_bytes` of A's scratch and $pb through B),
    `block_end` adds the block to the totals $t0..$t3, which are stored (plus the bias) per panel."""
    m, n = spec.m, spec.n
    blocks = -(-spec.k // spec.block)
    code_bytes = PANEL * spec.block * spec.bits // 8

    def store_panel(columns: int) -> list[str]:
        lines = []
        for g in range(GROUPS):
            lanes = max(0, min(4, columns - 4 * g))
            if lanes == 0:
                continue
            column = f"(i32.add (i32.shl (local.get $p) (i32.const 6)) (i32.const {16 * g}))"
            if at.bias is not None:
                lines.append(f"(local.set $t{g} (f32x4.add (local.get $t{g}) {load_lanes(at.bias, column, lanes)}))")
            lines += store_lanes(at.c, f"(i32.add {column} (i32.mul (local.get $r) (i32.const {n * 4})))", lanes, f"$t{g}")
        return lines

    panel_body = [
        *(f"(local.set $t{g} (v128.const f32x4 0 0 0 0))" for g in range(GROUPS)),
        f"(local.set $pa (i32.add (i32.const {at.scratch}) (i32.mul (local.get $r) (i32.const {row_bytes}))))",
        "(local.set $blk (i32.const 0))",
        "(loop $block",
        *("  " + line for line in accumulators),
        f"  (local.set $pend (i32.add (local.get $pb) (i32.const {code_bytes})))",
        "  (loop $chunk",
        *("    " + line for line in chunk),
        "    (br_if $chunk (i32.lt_u (local.get $pb) (local.get $pend))))",
        *("  " + line for line in block_end),
        "  (local.set $blk (i32.add (local.get $blk) (i32.const 1)))",
        f"  (br_if $block (i32.lt_u (local.get $blk) (i32.const {blocks}))))",
    ]
    panels, edge = divmod(n, PANEL)
    product = ["(local.set $r (i32.const 0))", "(loop $prow",
               f"  (local.set $pb (i32.const {at.b}))", "  (local.set $p (i32.const 0))"]
    if panels:
        product += ["  (loop $panel", *("    " + line for line in panel_body + store_panel(PANEL)),
                    "    (local.set $p (i32.add (local.get $p) (i32.const 1)))",
                    f"    (br_if $panel (i32.lt_u (local.get $p) (i32.const {panels}))))"]
    if edge:
        product += [*("  " + line for line in panel_body + store_panel(edge))]
    return product + ["  (local.set $r (i32.add (local.get $r) (i32.const 1)))",
                      f"  (br_if $prow (i32.lt_u (local.get $r) (i32.const {m}))))"]


def _render_float_a(spec: BlockQuantGemmSpec, at: BlockQuantOffsets, features: frozenset[str], name: str) -> str:
    """The weight-only arithmetic (see the module docstring)."""
    m, n, k, bits, block = spec.m, spec.n, spec.k, spec.bits, spec.block
    blocks = -(-k // block)
    padded_k = blocks * block
    sums_at = at.scratch + m * padded_k * 4
    fma = "relaxed-simd" in features
    per_chunk = _k_per_chunk(bits)
    code_bytes = PANEL * block * bits // 8

    def madd(x: str, y: str, acc: str) -> str:
        return f"(f32x4.relaxed_madd {x} {y} {acc})" if fma else f"(f32x4.add (f32x4.mul {x} {y}) {acc})"

    copy = [
        "(local.set $r (i32.const 0))",
        "(loop $rows",
        "  (local.set $blk (i32.const 0))",
        f"  (local.set $arow (i32.add (i32.const {at.a}) (i32.mul (local.get $r) (i32.const {k * 4}))))",
        "  (loop $blocks",
        f"    (local.set $k0 (i32.mul (local.get $blk) (i32.const {block})))",
        "    (local.set $sum (f32.const 0))",
        "    (local.set $kk (local.get $k0))",
        "    (loop $copy",
        f"      (local.set $x (select (f32.load (i32.add (local.get $arow) (i32.shl (select (local.get $kk) (i32.const 0) "
        f"(i32.lt_u (local.get $kk) (i32.const {k}))) (i32.const 2)))) (f32.const 0) (i32.lt_u (local.get $kk) (i32.const {k}))))",
        f"      (f32.store offset={at.scratch} (i32.shl (i32.add (i32.mul (local.get $r) (i32.const {padded_k})) "
        "(local.get $kk)) (i32.const 2)) (local.get $x))",
        "      (local.set $sum (f32.add (local.get $sum) (local.get $x)))",
        "      (local.set $kk (i32.add (local.get $kk) (i32.const 1)))",
        f"      (br_if $copy (i32.lt_u (local.get $kk) (i32.add (local.get $k0) (i32.const {block})))))",
        f"    (f32.store offset={sums_at} (i32.shl (i32.add (i32.mul (local.get $r) (i32.const {blocks})) "
        "(local.get $blk)) (i32.const 2)) (local.get $sum))",
        "    (local.set $blk (i32.add (local.get $blk) (i32.const 1)))",
        f"    (br_if $blocks (i32.lt_u (local.get $blk) (i32.const {blocks}))))",
        "  (local.set $r (i32.add (local.get $r) (i32.const 1)))",
        f"  (br_if $rows (i32.lt_u (local.get $r) (i32.const {m}))))",
    ]

    def lanes_of(j: int) -> str:     # byte j, 4+j, 8+j, 12+j of the codes as i32 lanes (16: a zero byte)
        return " ".join(f"{4 * i + j} 16 16 16" for i in range(4))

    chunk = [f"(local.set $a{j} (v128.load32_splat offset={4 * j} (local.get $pa)))" for j in range(per_chunk)]
    for g in range(GROUPS):
        chunk.append(f"(local.set $v (v128.load offset={16 * g} (local.get $pb)))")
        halves = [("(v128.and (local.get $v) (v128.const i8x16 " + " ".join(["15"] * 16) + "))", 0),
                  ("(i8x16.shr_u (local.get $v) (i32.const 4))", 4)] if bits == 4 else [("(local.get $v)", 0)]
        for codes, first in halves:
            chunk.append(f"(local.set $w {codes})")
            for j in range(4):
                widened = f"(f32x4.convert_i32x4_s (i8x16.shuffle {lanes_of(j)} (local.get $w) (v128.const i32x4 0 0 0 0)))"
                chunk.append(f"(local.set $s{g} {madd(widened, f'(local.get $a{first + j})', f'(local.get $s{g})')})")
    chunk += [f"(local.set $pa (i32.add (local.get $pa) (i32.const {4 * per_chunk})))",
              f"(local.set $pb (i32.add (local.get $pb) (i32.const {GROUPS * 16})))"]

    block_end = [f"(local.set $sums (f32x4.splat (f32.load offset={sums_at} (i32.shl (i32.add (i32.mul (local.get $r) "
                 f"(i32.const {blocks})) (local.get $blk)) (i32.const 2)))))"]
    if spec.zero_points:
        block_end += ZERO_POINTS_LOADED
    for g in range(GROUPS):
        if spec.zero_points:
            zero = f"(f32x4.convert_i32x4_s {zero_points_of(g)})"
        else:
            zero = f"(v128.const f32x4 {' '.join([str(2 ** (bits - 1))] * 4)})"
        centred = f"(f32x4.sub (local.get $s{g}) (f32x4.mul {zero} (local.get $sums)))"
        block_end.append(f"(local.set $t{g} {madd(centred, f'(v128.load offset={16 * g} (local.get $pb))', f'(local.get $t{g})')})")
    block_end.append(f"(local.set $pb (i32.add (local.get $pb) (i32.const {block_bytes(spec) - code_bytes})))")

    accumulators = [f"(local.set $s{g} (v128.const f32x4 0 0 0 0))" for g in range(GROUPS)]
    product = _rows_of_panels(spec, at, padded_k * 4, accumulators, chunk, block_end)
    decls = ["(local $r i32) (local $blk i32) (local $k0 i32) (local $kk i32) (local $arow i32) (local $p i32) "
             "(local $pa i32) (local $pb i32) (local $pend i32) (local $x f32) (local $sum f32)",
             "(local $v v128) (local $w v128) (local $sums v128) (local $zlo v128) (local $zhi v128) "
             + " ".join(f"(local $t{g} v128) (local $s{g} v128)" for g in range(GROUPS)),
             " ".join(f"(local $a{j} v128)" for j in range(per_chunk))]
    title = (f";; C[{m}x{n}] = A[{m}x{k}] @ B ({bits}-bit blocks of {block}{', zero points' if spec.zero_points else ''})"
             f"{' + bias' if at.bias is not None else ''}, float32 A, codes widened in registers")
    return "\n".join([f"(func ${name}", "  " + title, *("  " + d for d in decls),
                      *("  " + line for line in copy + product), ")"]) + "\n"
