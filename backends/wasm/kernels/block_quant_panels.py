"""MatMulNBits' blocks for products of more than two rows (kernels/block_quant.py has the other
cases): the float32 GEMM's tiles (backends/wasm/gemm.py) over B widened one panel's K block at a
time, and, at accuracy level 4, over A read as its int8 codes times their block scales.

Above two rows B is read once per row tile, not once per row, so widening each panel's K block
once into float32 scratch (b_format "q4" / "q8") costs little and the tiles run at the float32
kernel's speed; the widened values are exactly (code - zero) * scale. With int8 A
(`render_requantized_rows`), sum_k (qa sa)(qb sb) is onnxruntime's sa sb sum_k qa qb up to float32
rounding of the products and sums. The integer kernel is no faster here: SIMD128's relaxed dot
lowers to three instructions on x86 (16 products), the tiles' FMA to one (4 products), and unpacking
codes per row costs more than widening a block once for all rows (512^3 4-bit: integer kernel 27.7
GFLOP/s, float32 kernel 45).
"""

from __future__ import annotations

import numpy as np

from ir.loops.contraction import BlockQuantGemmSpec, BlockQuantWeight

PANEL = 16
GEMV_ROWS = 2


def uses_gemm_tiles(spec: BlockQuantGemmSpec) -> bool:
    return spec.m > GEMV_ROWS


def requantized_rows_bytes(spec: BlockQuantGemmSpec) -> int:
    """The scratch `render_requantized_rows` writes: A's values after int8 quantization."""
    return spec.m * spec.k * 4 if spec.int8_a else 0


def panel_step_bytes(bits: int) -> int:
    """Bytes of one k step of one 16-column panel of codes."""
    return PANEL * bits // 8


def panel_tables_at(bits: int, k: int, n: int, block: int) -> int:
    """Where the per-block tables start in `pack_block_quant_panels`' bytes."""
    return -(-n // PANEL) * -(-k // block) * block * panel_step_bytes(bits)


TABLE_BYTES = PANEL * 4 + PANEL     # one panel's block: 16 float32 scales, 16 zero point codes


def pack_block_quant_panels(spec: BlockQuantGemmSpec, weight: BlockQuantWeight) -> np.ndarray:
    """B for the GEMM's tiles: codes in 16-column panels [panels][K rounded up to blocks][16] (4-bit: 8
    bytes a k step, byte c holding column c's code and column c + 8's in its high nibble), then per
    panel and block the 16 columns' float32 scales and their zero point codes (the middle code
    without zero points)."""
    n, k, block, bits = spec.n, spec.k, spec.block, spec.bits
    panels, blocks = -(-n // PANEL), -(-k // block)
    codes = np.zeros((panels * PANEL, blocks * block), np.uint8)
    codes[:n, :k] = weight.codes
    steps = codes.reshape(panels, PANEL, blocks * block).transpose(0, 2, 1)      # [p][k][16]
    if bits == 4:
        steps = steps[..., :8] | (steps[..., 8:] << 4)
    scales = np.zeros((panels * PANEL, blocks), "<f4")
    scales[:n] = weight.scales
    zeros = np.full((panels * PANEL, blocks), 2 ** (bits - 1), np.uint8)
    if weight.zeros is not None:
        zeros[:n] = weight.zeros
    tables = np.concatenate([scales.reshape(panels, PANEL, blocks).transpose(0, 2, 1).copy().view(np.uint8),
                             zeros.reshape(panels, PANEL, blocks).transpose(0, 2, 1)], axis=2)
    return np.concatenate([np.ascontiguousarray(steps).reshape(-1), np.ascontiguousarray(tables).reshape(-1)])


BLOCK_WIDENING_LOCALS = ("(local $qk i32) (local $qtab i32) (local $qstop i32) "
                         "(local $qz0 v128) (local $qz1 v128) (local $qz2 v128) (local $qz3 v128)")
_NIBBLES_TO_BYTES = "0 1 2 3 4 5 6 7 16 17 18 19 20 21 22 23"


def render_block_quant_widening(bits: int, block: int, k: int, n: int, base: str, dst: int, k0: str,
                                steps: str) -> list[str]:
    """WAT lines: the `steps` k steps from `k0` (i32 expressions) of panel $j of
    `pack_block_quant_panels`' bytes at `base`, as float32 panel rows [steps][16] at `dst`. The
    function must declare narrow_panels.WIDENING_LOCALS and BLOCK_WIDENING_LOCALS."""
    step = panel_step_bytes(bits)
    blocks = -(-k // block)
    padded_k = blocks * block
    if bits == 4:
        load = [f"(local.set $w0 (v128.load64_zero (local.get $wsrc)))",
                f"(local.set $w0 (i8x16.shuffle {_NIBBLES_TO_BYTES} (v128.and (local.get $w0) "
                f"(v128.const i8x16 {' '.join(['15'] * 16)})) (i8x16.shr_u (local.get $w0) (i32.const 4))))"]
    else:
        load = ["(local.set $w0 (v128.load (local.get $wsrc)))"]
    zero = "(v128.const i32x4 0 0 0 0)"

    def lanes(v: int) -> str:
        return " ".join(f"{4 * v + lane} 16 16 16" for lane in range(4))

    def codes_of(v: int) -> str:
        return f"(f32x4.convert_i32x4_u (i8x16.shuffle {lanes(v)} (local.get $w0) {zero}))"

    return [
        "(local.set $qk " + k0 + ")",
        f"(local.set $wsrc (i32.add {base} (i32.mul (i32.add (i32.mul (local.get $j) (i32.const {padded_k})) "
        f"(local.get $qk)) (i32.const {step}))))",
        f"(local.set $wdst (i32.const {dst}))",
        f"(local.set $wend (i32.add (i32.const {dst}) (i32.mul {steps} (i32.const 64))))",
        "(loop $widen_block",
        f"  (local.set $qtab (i32.add (i32.add {base} (i32.const {panel_tables_at(bits, k, n, block)})) "
        f"(i32.mul (i32.add (i32.mul (local.get $j) (i32.const {blocks})) (i32.div_u (local.get $qk) "
        f"(i32.const {block}))) (i32.const {TABLE_BYTES}))))",
        *(f"  (local.set $ws{v} (v128.load offset={16 * v} (local.get $qtab)))" for v in range(4)),
        "  (local.set $w1 (v128.load offset=64 (local.get $qtab)))",
        *(f"  (local.set $qz{v} (f32x4.convert_i32x4_u (i8x16.shuffle {lanes(v)} (local.get $w1) {zero})))"
          for v in range(4)),
        # the quant block ends at the next multiple of `block`, or the K block before it
        f"  (local.set $qstop (i32.add (local.get $wdst) (i32.shl (i32.sub (i32.const {block}) (i32.rem_u "
        f"(local.get $qk) (i32.const {block}))) (i32.const 6))))",
        "  (local.set $qstop (select (local.get $qstop) (local.get $wend) (i32.lt_u (local.get $qstop) (local.get $wend))))",
        "  (local.set $qk (i32.add (local.get $qk) (i32.shr_u (i32.sub (local.get $qstop) (local.get $wdst)) (i32.const 6))))",
        "  (loop $widen",
        *("    " + line for line in load),
        *(f"    (v128.store offset={16 * v} (local.get $wdst) (f32x4.mul (f32x4.sub {codes_of(v)} (local.get $qz{v})) "
          f"(local.get $ws{v})))" for v in range(4)),
        f"    (local.set $wsrc (i32.add (local.get $wsrc) (i32.const {step})))",
        "    (local.set $wdst (i32.add (local.get $wdst) (i32.const 64)))",
        "    (br_if $widen (i32.lt_u (local.get $wdst) (local.get $qstop))))",
        "  (br_if $widen_block (i32.lt_u (local.get $wdst) (local.get $wend))))",
    ]


def render_requantized_rows(m: int, k: int, block: int, a: int, dst: int, name: str) -> str:
    """`(func $name)`: A [m, k] float32 at `a` to [m, k] at `dst` as onnxruntime's level 4 reads it:
    per row and block of K, code * scale with scale = max|a| / 127 and code =
    round_half_even(a * (127 / max|a|)) (0 for an all-zero block). Four values a vector, the
    block's last k % 4 one at a time."""
    blocks = -(-k // block)

    def at(offset: int) -> str:
        return f"offset={offset} (i32.add (local.get $arow) (i32.shl (local.get $kk) (i32.const 2)))"

    def four_then_one(vector: list[str], scalar: list[str]) -> list[str]:
        """`vector` over k in [$k0, $vend) by 4, then `scalar` over [$vend, $kend)."""
        return ["(local.set $kk (local.get $k0))",
                "(block $vectors_done (loop $vectors",
                "  (br_if $vectors_done (i32.ge_u (local.get $kk) (local.get $vend)))",
                *("  " + line for line in vector),
                "  (local.set $kk (i32.add (local.get $kk) (i32.const 4)))",
                "  (br $vectors)))",
                "(block $scalars_done (loop $scalars",
                "  (br_if $scalars_done (i32.ge_u (local.get $kk) (local.get $kend)))",
                *("  " + line for line in scalar),
                "  (local.set $kk (i32.add (local.get $kk) (i32.const 1)))",
                "  (br $scalars)))"]

    code = [
        "(local.set $r (i32.const 0))",
        "(loop $rows",
        f"  (local.set $arow (i32.mul (local.get $r) (i32.const {k * 4})))",
        "  (local.set $blk (i32.const 0))",
        "  (loop $blocks",
        f"    (local.set $k0 (i32.mul (local.get $blk) (i32.const {block})))",
        f"    (local.set $kend (select (i32.add (local.get $k0) (i32.const {block})) (i32.const {k}) "
        f"(i32.lt_u (i32.add (local.get $k0) (i32.const {block})) (i32.const {k}))))",
        "    (local.set $vend (i32.sub (local.get $kend) (i32.and (i32.sub (local.get $kend) (local.get $k0)) (i32.const 3))))",
        "    (local.set $vmax (v128.const f32x4 0 0 0 0))",
        "    (local.set $amax (f32.const 0))",
        *("    " + line for line in four_then_one(
            [f"(local.set $vmax (f32x4.max (local.get $vmax) (f32x4.abs (v128.load {at(a)}))))"],
            [f"(local.set $amax (f32.max (local.get $amax) (f32.abs (f32.load {at(a)}))))"])),
        *(f"    (local.set $amax (f32.max (local.get $amax) (f32x4.extract_lane {lane} (local.get $vmax))))"
          for lane in range(4)),
        "    (local.set $scale (f32.div (local.get $amax) (f32.const 127)))",
        "    (local.set $inverse (select (f32.const 0) (f32.div (f32.const 127) (local.get $amax)) "
        "(f32.eq (local.get $amax) (f32.const 0))))",
        "    (local.set $vscale (f32x4.splat (local.get $scale)))",
        "    (local.set $vinverse (f32x4.splat (local.get $inverse)))",
        *("    " + line for line in four_then_one(
            [f"(v128.store {at(dst)} (f32x4.mul (f32x4.convert_i32x4_s (i32x4.trunc_sat_f32x4_s (f32x4.nearest "
             f"(f32x4.mul (v128.load {at(a)}) (local.get $vinverse))))) (local.get $vscale)))"],
            [f"(f32.store {at(dst)} (f32.mul (f32.convert_i32_s (i32.trunc_sat_f32_s (f32.nearest "
             f"(f32.mul (f32.load {at(a)}) (local.get $inverse))))) (local.get $scale)))"])),
        "    (local.set $blk (i32.add (local.get $blk) (i32.const 1)))",
        f"    (br_if $blocks (i32.lt_u (local.get $blk) (i32.const {blocks}))))",
        "  (local.set $r (i32.add (local.get $r) (i32.const 1)))",
        f"  (br_if $rows (i32.lt_u (local.get $r) (i32.const {m}))))",
    ]
    decls = ("(local $r i32) (local $arow i32) (local $blk i32) (local $k0 i32) (local $kend i32) (local $vend i32) "
             "(local $kk i32) (local $amax f32) (local $scale f32) (local $inverse f32) (local $vmax v128) "
             "(local $vscale v128) (local $vinverse v128)")
    return "\n".join([f"(func ${name}", f"  ;; A[{m}x{k}] quantized to int8 per block of {block}, as float32",
                      "  " + decls, *("  " + line for line in code), ")"]) + "\n"
