"""The run-time packing of the integer GEMM's A (kernels/int8_gemm.py) minus its zero point, in
groups of 4 rows (rows past M repeat the last row; their sums are never stored):

- 16-bit (`render_pack_a(..., relaxed=False)`): one group at a time (at $g, into the same scratch,
  which the group's tiles then read), each row's k pair (A[i, k] - a_zero, A[i, k + 1] - a_zero) as
  int16 already broadcast to the 4 lanes of a v128: [ceil(K/2)][4 rows][4 lanes][2], 64 bytes per
  k pair (the k past K are zero). The tile's k loop then reads each row's operand of
  `i32x4.dot_i16x8_s` with a plain load instead of broadcasting it with a shuffle: on x86 the
  shuffle takes a vector ALU slot that the dot products and their adds need (the 4 x 8 tile alone,
  bench/int8_tile_bench.py: 48-53 -> 54-60 GMAC/s), and a load slot is free. The price, 4x the
  bytes of a group, is why one group is packed at a time: K x 32 bytes of scratch.
- 8-bit, relaxed SIMD (`relaxed=True`): A as int8 (uint8 A shifted by -128), 4 k of 4 rows per
  v128, [ceil(M/4)][ceil(K/4)][4 rows][4], each row's sum after the groups (the relaxed kernel's
  correction).
"""

from __future__ import annotations

from backends.wasm.kernels.int8_panels import counted_loop, pairs
from backends.wasm.simd_lanes import shuffle_lanes
from ir.loops.contraction import IntegerGemmSpec

ROWS = 4            # rows per packed A group and per register tile
BROADCAST_PAIR_BYTES = ROWS * 16   # one k pair of a 16-bit group: a v128 per row


def quads(k: int) -> int:
    return -(-k // 4)


def groups(m: int) -> int:
    return -(-m // ROWS)


def steps(k: int, relaxed: bool) -> int:
    """k steps of the tile's loop: one per k pair (16-bit), or per 4 k (8-bit, relaxed)."""
    return quads(k) if relaxed else pairs(k)


def group_bytes(k: int, relaxed: bool) -> int:
    """The packed bytes of one group of 4 rows."""
    return steps(k, relaxed) * (16 if relaxed else BROADCAST_PAIR_BYTES)


def shift_of(spec: IntegerGemmSpec) -> int:
    """What the relaxed kernel subtracts from A to make it int8: 128 for uint8 A."""
    return 0 if spec.a_signed else 128


def packed_a_bytes(spec: IntegerGemmSpec, relaxed: bool) -> int:
    """The scratch of packed A: one 16-bit group, or every relaxed group and the row sums after them."""
    if not relaxed:
        return group_bytes(spec.k, False)
    return groups(spec.m) * group_bytes(spec.k, True) + 4 * ROWS * groups(spec.m)


def render_pack_a(spec: IntegerGemmSpec, a_zero: int | None, packed: int, relaxed: bool) -> tuple[list[str], list[str]]:
    """(reading the zero point at `a_zero` (None: 0) once per call into $za / $zv; packing the
    product's A at $abase: relaxed, every group into `packed`; 16-bit, the group at $g only, for the
    caller to run once per group). Uses the GEMM function's locals."""
    sign = "s" if spec.a_signed else "u"
    load_zero = f"(i32.load8_{sign} (i32.const {a_zero}))" if a_zero is not None else "(i32.const 0)"
    code = [f"(local.set $za {load_zero})", "(local.set $zv (i16x8.splat (local.get $za)))"]
    if relaxed:   # A = packed A + shift: the correction's factor of B's column sums
        code.append(f"(local.set $szv (i32x4.splat (i32.sub (i32.const {shift_of(spec)}) (local.get $za))))")
        return code, _pack_bytes(spec, packed)
    return code, _pack_broadcast_pairs(spec, packed)


def _row(spec: IntegerGemmSpec, r: int) -> str:
    """The address of row 4g + r of A, the rows past M clamped to the last."""
    index = f"(i32.add (i32.shl (local.get $g) (i32.const 2)) (i32.const {r}))"
    if spec.m % ROWS:
        index = f"(select {index} (i32.const {spec.m - 1}) (i32.lt_u {index} (i32.const {spec.m})))"
    return f"(i32.add (local.get $abase) (i32.mul {index} (i32.const {spec.k})))"


def _pack_broadcast_pairs(spec: IntegerGemmSpec, packed: int) -> list[str]:
    """Group $g's rows, 8 k at a time: one 8-byte load widened to int16 less the zero point (4 k
    pairs, one per 32-bit lane), each lane broadcast into its own v128; the last k pairs one value
    at a time."""
    k = spec.k
    sign = "s" if spec.a_signed else "u"
    blocks = k // 8
    code = [f"(local.set $pa (i32.const {packed}))"]
    for r in range(ROWS):
        code.append(f"(local.set $src {_row(spec, r)})")
        if blocks:
            widened = f"(i16x8.extend_low_i8x16_{sign} (v128.load64_zero (local.get $src)))"
            step = [f"(local.set $x0 (i16x8.sub {widened} (local.get $zv)))"]
            step += [f"(v128.store offset={16 * r + lane * BROADCAST_PAIR_BYTES} (local.get $p) "
                     f"(i8x16.shuffle {shuffle_lanes(lane, lane, lane, lane)} (local.get $x0) (local.get $x0)))"
                     for lane in range(4)]
            step += ["(local.set $src (i32.add (local.get $src) (i32.const 8)))",
                     f"(local.set $p (i32.add (local.get $p) (i32.const {4 * BROADCAST_PAIR_BYTES})))"]
            code += ["(local.set $p (local.get $pa))", *_loop_until("$bk", blocks, step)]
        for pair in range(4 * blocks, pairs(k)):
            kk = 2 * pair - 8 * blocks   # k offset from $src, which the blocks left after them
            low = f"(i32.sub (i32.load8_{sign} offset={kk} (local.get $src)) (local.get $za))"
            high = (f"(i32.shl (i32.sub (i32.load8_{sign} offset={kk + 1} (local.get $src)) (local.get $za)) (i32.const 16))"
                    if 2 * pair + 1 < k else "(i32.const 0)")
            value = f"(i32.or (i32.and {low} (i32.const 65535)) {high})"
            code.append(f"(v128.store offset={16 * r + pair * BROADCAST_PAIR_BYTES} (local.get $pa) (i32x4.splat {value}))")
    return code


def _loop_until(label: str, count: int, body: list[str]) -> list[str]:
    """body `count` times (count >= 1), counted down in $n."""
    if count == 1:
        return body
    loop = label.replace("$", "$loop_")
    return [f"(local.set $n (i32.const {count}))", f"(loop {loop}", *("  " + s for s in body),
            "  (local.set $n (i32.sub (local.get $n) (i32.const 1)))", f"  (br_if {loop} (local.get $n)))"]


def _pack_bytes(spec: IntegerGemmSpec, packed: int) -> list[str]:
    """The relaxed kernel's A: int8 (uint8 A shifted by -128), 16 k of 4 rows per step (a 4 x 4
    transpose of the rows' 32-bit lanes) with each row's sum after the groups; the last k one value
    at a time."""
    m, k = spec.m, spec.k
    sign = "s" if spec.a_signed else "u"
    per_step, width = 16, 4   # k per packing step, k per 32-bit lane
    size = group_bytes(k, True)
    shift = shift_of(spec)
    group = [f"(local.set $pa (i32.add (i32.const {packed}) (i32.mul (local.get $g) (i32.const {size}))))"]
    group += [f"(local.set $s{r} (v128.const i32x4 0 0 0 0))" for r in range(ROWS)]
    group += [f"(local.set $t{r} (i32.const 0))" for r in range(ROWS)]
    blocks = k // per_step
    if blocks:
        low = (f"(i8x16.shuffle {shuffle_lanes(0, 4, 1, 5)} (local.get $x0) (local.get $x1))",
               f"(i8x16.shuffle {shuffle_lanes(0, 4, 1, 5)} (local.get $x2) (local.get $x3))")
        high = (f"(i8x16.shuffle {shuffle_lanes(2, 6, 3, 7)} (local.get $x0) (local.get $x1))",
                f"(i8x16.shuffle {shuffle_lanes(2, 6, 3, 7)} (local.get $x2) (local.get $x3))")
        step = []
        for r in range(ROWS):
            value = f"(v128.load (i32.add {_row(spec, r)} (i32.shl (local.get $p) (i32.const 4))))"
            if shift:
                value = f"(v128.xor {value} (v128.const i8x16 {' '.join(['-128'] * 16)}))"
            pairwise = f"(i32x4.extadd_pairwise_i16x8_s (i16x8.extadd_pairwise_i8x16_s (local.get $x{r})))"
            step += [f"(local.set $x{r} {value})", f"(local.set $s{r} (i32x4.add (local.get $s{r}) {pairwise}))"]
        step += [f"(local.set $lo {low[0]})", f"(local.set $hi {low[1]})",
                 f"(v128.store (local.get $pa) (i8x16.shuffle {shuffle_lanes(0, 1, 4, 5)} (local.get $lo) (local.get $hi)))",
                 f"(v128.store offset=16 (local.get $pa) (i8x16.shuffle {shuffle_lanes(2, 3, 6, 7)} (local.get $lo) (local.get $hi)))",
                 f"(local.set $lo {high[0]})", f"(local.set $hi {high[1]})",
                 f"(v128.store offset=32 (local.get $pa) (i8x16.shuffle {shuffle_lanes(0, 1, 4, 5)} (local.get $lo) (local.get $hi)))",
                 f"(v128.store offset=48 (local.get $pa) (i8x16.shuffle {shuffle_lanes(2, 3, 6, 7)} (local.get $lo) (local.get $hi)))",
                 "(local.set $pa (i32.add (local.get $pa) (i32.const 64)))"]
        group += counted_loop("$p", blocks, step)
    for kk in range(per_step * blocks, width * quads(k)):   # the tail, and zeros up to a whole lane
        for r in range(ROWS):
            at_pa = f"offset={(kk - per_step * blocks) // width * 16 + 4 * r + kk % width}"
            if kk >= k:
                group.append(f"(i32.store8 {at_pa} (local.get $pa) (i32.const 0))")
                continue
            value = f"(i32.load8_{sign} offset={kk} {_row(spec, r)})"
            group += [f"(local.set $src {f'(i32.sub {value} (i32.const {shift}))' if shift else value})",
                      f"(i32.store8 {at_pa} (local.get $pa) (local.get $src))",
                      f"(local.set $t{r} (i32.add (local.get $t{r}) (local.get $src)))"]
    sums = groups(m) * size   # the row sums, after the groups
    for r in range(ROWS):
        total = f"(local.get $t{r})"
        for lane in range(4):
            total = f"(i32.add {total} (i32x4.extract_lane {lane} (local.get $s{r})))"
        group.append(f"(i32.store offset={packed + sums + 4 * r} (i32.shl (local.get $g) (i32.const 4)) {total})")
    return counted_loop("$g", groups(m), group)
