"""The run-time packer of the integer kernels' activation operand: K rows of N bytes (row stride N)
as int16 8-column panels of k pairs less a zero point, [ceil(N/8)][ceil(K/2)][8][2], the layout
int8_gemm's tiles read as their B side. The integer Conv packs its im2col matrix (or its 1x1 input)
this way per group (kernels/int8_conv.py), the integer GEMM a B that is an activation per product
(attention's Q @ K^T and scores @ V, kernels/int8_gemm.py)."""

from __future__ import annotations

from backends.wasm.kernels.wat_loops import counted_range

PANEL = 8           # columns per packed panel: two v128 of 4 int32 sums in a tile

# i8x16.shuffle bytes interleaving the 16-bit lanes of two vectors: (a0 b0 a1 b1 a2 b2 a3 b3), and
# the same of lanes 4..7
_LOW_PAIRS = "0 1 16 17 2 3 18 19 4 5 20 21 6 7 22 23"
_HIGH_PAIRS = "8 9 24 25 10 11 26 27 12 13 28 29 14 15 30 31"


def pairs(k: int) -> int:
    return -(-k // 2)


def panels(n: int) -> int:
    return -(-n // PANEL)


def panels_bytes(n: int, k: int) -> int:
    """The bytes of one K x N operand packed as panels."""
    return panels(n) * pairs(k) * PANEL * 4


def counted_loop(var: str, count: int, body: list[str]) -> list[str]:
    """body for var in 0 .. count - 1 (count >= 1, known at compile time)."""
    return counted_range(var, 0, count, 1, body)


def render_pack_panels(n: int, k: int, signed: bool, dst: int, name: str) -> str:
    """`(func $name (param $src $za))`: K rows of N bytes at $src (row stride N, int8 with `signed`,
    else uint8) as 8-column panels of int16 k pairs of x - za at `dst`. A whole panel's two rows of
    a pair are two 8-byte loads, widened, less za, and interleaved; the last, partial panel goes
    value by value (its lanes past N are left as they are: their sums are never stored)."""
    sign = "s" if signed else "u"
    full_panels, rest = divmod(n, PANEL)
    panel_bytes = pairs(k) * PANEL * 4

    def widened(offset: int) -> str:
        return (f"(i16x8.sub (i16x8.extend_low_i8x16_{sign} (v128.load64_zero offset={offset} (local.get $r))) "
                "(local.get $zv))")

    def vector_pair(second_row: bool) -> list[str]:
        return [f"(local.set $lo {widened(0)})",
                f"(local.set $hi {widened(n) if second_row else '(v128.const i32x4 0 0 0 0)'})",
                f"(v128.store (local.get $d) (i8x16.shuffle {_LOW_PAIRS} (local.get $lo) (local.get $hi)))",
                f"(v128.store offset=16 (local.get $d) (i8x16.shuffle {_HIGH_PAIRS} (local.get $lo) (local.get $hi)))"]

    def scalar_pair(second_row: bool) -> list[str]:
        code = []
        for j in range(rest):
            code.append(f"(i32.store16 offset={4 * j} (local.get $d) (i32.sub (i32.load8_{sign} offset={j} "
                        "(local.get $r)) (local.get $za)))")
            second = (f"(i32.sub (i32.load8_{sign} offset={n + j} (local.get $r)) (local.get $za))" if second_row
                      else "(i32.const 0)")
            code.append(f"(i32.store16 offset={4 * j + 2} (local.get $d) {second})")
        return code

    advance = ["(local.set $d (i32.add (local.get $d) (i32.const 32)))",
               f"(local.set $r (i32.add (local.get $r) (i32.const {2 * n})))"]

    def panel(pair) -> list[str]:
        code = counted_loop("$kp", k // 2, pair(True) + advance) if k // 2 else []
        return code + (pair(False) if k % 2 else [])

    body = []
    if full_panels:
        body += counted_loop("$pn", full_panels, [
            f"(local.set $d (i32.add (i32.const {dst}) (i32.mul (local.get $pn) (i32.const {panel_bytes}))))",
            "(local.set $r (i32.add (local.get $src) (i32.shl (local.get $pn) (i32.const 3))))",
            *panel(vector_pair)])
    if rest:
        body += [f"(local.set $d (i32.const {dst + full_panels * panel_bytes}))",
                 f"(local.set $r (i32.add (local.get $src) (i32.const {full_panels * PANEL})))", *panel(scalar_pair)]
    lines = [f"(func ${name} (param $src i32) (param $za i32)",
             "  (local $zv v128) (local $lo v128) (local $hi v128) (local $r i32) (local $d i32) (local $kp i32) (local $pn i32)",
             "  (local.set $zv (i16x8.splat (local.get $za)))", *("  " + s for s in body), ")"]
    return "\n".join(lines) + "\n"
