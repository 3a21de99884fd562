"""The 8-bit integer GEMM of the WebAssembly backend (MatMulInteger, QLinearMatMul): SIMD128
`i32x4.dot_i16x8_s` over operands widened to 16 bits, as one WAT function per product.

C[i, j] = sum_k (A[i, k] - a_zero) * B'[k, j], B' = B - b_zero (`IntegerGemmSpec`: the lowering
subtracted B's zero point). Both factors lie in -255..255, so every product and every pair sum of
`dot_i16x8_s` is exact, and the int32 sums wrap exactly as the loop nest's do: the result is
bit-identical to it, whatever K.

Layouts (i16 little-endian, k in pairs so that one 32-bit lane holds (k, k + 1)):
- B', packed at compile time (`pack_b`): panels of 8 columns, [ceil(N/8)][ceil(K/2)][8][2], the
  columns past N and the k past K zero. A panel row (one k pair) is two v128 of 4 columns each.
  A B that is an activation (attention's Q @ K^T and scores @ V in a quantized transformer) is
  packed the same way at run time, B - b_zero, once per product of the batch, into the scratch
  (`$name_pack_b`, kernels/int8_panels.py: the integer Conv's packer of its im2col matrix).
- A, packed at run time with its zero point subtracted (kernels/int8_pack_a.py), one group of 4
  rows at a time into the scratch, right before the tiles of that group: each row's k pair
  broadcast to a v128, [ceil(K/2)][4][4][2] (rows past M repeat the last row and are never
  stored; the k past K are zero).
A 4-row tile of one panel is one pass over K of 8 accumulators (4 rows x 2 vectors): per k pair four
loads of A, two of B and 8 `dot` + `add`, nothing else on the vector ALUs (which bound it on x86:
a dot and its add are two of their slots per 8 products; more accumulators than 8 spill under
Cranelift: 29-35 GMAC/s against 54-60 for this tile alone, bench/int8_tile_bench.py). The k loop is
a function of its own (as the float GEMM's, kernels/microkernel.py: Cranelift then allocates its
registers without the epilogue's) that leaves the tile's sums in a 128-byte scratch tile, which the
epilogue reads: stored as int32 (MatMulInteger), or requantised (QLinearMatMul) exactly as the loop
nest does in float32: scale_j = (a_scale * b_scale_j) / out_scale, y = saturate(nearest(float(acc) *
scale_j) + out_zero); the per-column scales are computed once per run into a scratch vector; or
dequantised to float32 (MatMulIntegerToFloat: float(acc) * scale_j + bias_j + residual, `_dequantized`).
Products of a batch run one after another, each packing its own A (and B when it is an activation).

Relaxed SIMD's dot product of int8 A and B' is deterministic only when its second operand's lanes
are 7-bit; `uses_relaxed_dot` and `pack_b(..., relaxed=True)` say when and how B' is encoded that
way. The k step is `i16x8.relaxed_dot_i8x16_i7x16_s`, `i32x4.extadd_pairwise_i16x8_s`, `i32x4.add`
(a pair's sum, at most 2 x 128 x 127 = 32512 in magnitude, fits 16 bits), not the accumulating
`i32x4.relaxed_dot_i8x16_i7x16_add_s`: Node 20's V8 (11.3, x64) computes that one wrong in this
kernel (twice the products, the accumulator dropped; tests/test_js_int8_relaxed.py). Under wasmtime
the two forms run at the same speed (bench/int8_gemm_bench.py, 7-bit weights, int32 out: 87-91 GOPS
either way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.wasm.kernels.int8_pack_a import (BROADCAST_PAIR_BYTES, ROWS, group_bytes, groups, packed_a_bytes, quads,
                                               render_pack_a, steps)
from backends.wasm.kernels.int8_panels import PANEL, counted_loop, pairs, panels, panels_bytes, render_pack_panels
from backends.wasm.simd_lanes import shuffle_lanes
from ir.loops.contraction import IntegerGemmSpec

TILE_BYTES = ROWS * PANEL * 4
K_UNROLL = 4        # k pairs per iteration of the tile's k loop


@dataclass(frozen=True)
class IntegerGemmOffsets:
    """Where the operands lie: A, packed B (`pack_b`; for a B that is an activation, the scratch it
    is packed into, `b_panels_bytes`, and `b_source` B itself), C, the scratch (`scratch_bytes`:
    packed A, the tile, the per-column scales), the quantisation scalars, and the dequantising
    epilogue's scale, bias and residual (None: absent)."""
    a: int
    b_packed: int
    c: int
    a_packed: int
    tile: int
    scales: int | None = None
    a_zero: int | None = None
    a_scale: int | None = None
    b_scale: int | None = None
    out_scale: int | None = None
    out_zero: int | None = None
    b_source: int | None = None
    b_zero: int | None = None
    dequantize_scale: int | None = None
    bias: int | None = None
    residual: int | None = None


def uses_relaxed_dot(spec: IntegerGemmSpec, features) -> bool:
    """Whether the kernel for `spec` runs on `i16x8.relaxed_dot_i8x16_i7x16_s`: with relaxed SIMD,
    when every column of B' spans at most 127 (then B' minus its column minimum is 7-bit, the
    operand lanes that give the same result on every host)."""
    return "relaxed-simd" in frozenset(features) and spec.constant_b and spec.b_column_span <= 127


def pack_b(b: np.ndarray, relaxed: bool = False) -> np.ndarray:
    """B' (K x N, values in -255..255) as int16 panels [ceil(N/8)][ceil(K/2)][8][2], as bytes. With
    `relaxed`: B' minus each column's minimum c as uint8 panels [ceil(N/8)][ceil(K/4)][8][4], then
    c and the column sums of B' as int32 (one per column of the padded panels)."""
    b = np.asarray(b)
    k, n = b.shape
    if relaxed:
        low = b.min(0).astype(np.int64)
        shifted = np.zeros((4 * quads(k), PANEL * panels(n)), np.uint8)
        if (b - low).max() > 127:
            raise ValueError("B' spans more than 7 bits in a column")
        shifted[:k, :n] = b - low
        packed = shifted.reshape(quads(k), 4, panels(n), PANEL).transpose(2, 0, 3, 1)
        columns = np.zeros((2, PANEL * panels(n)), "<i4")
        columns[0, :n], columns[1, :n] = low, b.astype(np.int64).sum(0)
        return np.frombuffer(np.ascontiguousarray(packed).tobytes() + columns.tobytes(), np.uint8)
    if b.size and (b.min() < -32768 or b.max() > 32767):
        raise ValueError("B' does not fit 16 bits")
    padded = np.zeros((2 * pairs(k), PANEL * panels(n)), "<i2")
    padded[:k, :n] = b
    packed = padded.reshape(pairs(k), 2, panels(n), PANEL).transpose(2, 0, 3, 1)
    return np.frombuffer(np.ascontiguousarray(packed).tobytes(), np.uint8)


def scratch_bytes(spec: IntegerGemmSpec, relaxed: bool = False) -> tuple[int, int, int]:
    """(packed A, with relaxed its row sums after it; the tile; the per-column scales: 0 without
    requantisation), in bytes."""
    scales = 4 * PANEL * panels(spec.n) if spec.requantize is not None else 0
    return packed_a_bytes(spec, relaxed), TILE_BYTES, scales


def b_panels_bytes(spec: IntegerGemmSpec) -> int:
    """The scratch a B that is an activation is packed into, one product's panels at a time (0 for
    a constant B, packed at compile time)."""
    return 0 if spec.constant_b else panels_bytes(spec.n, spec.k)


def output_size(spec: IntegerGemmSpec) -> int:
    """Bytes per element of C: int32 sums or float32, or requantised bytes."""
    return 1 if spec.requantize is not None else 4


def render_integer_gemm(spec: IntegerGemmSpec, at: IntegerGemmOffsets, name: str = "igemm", relaxed: bool = False) -> str:
    """`(func $name)` computing `spec` at the offsets `at`, followed by the functions it calls; with
    `relaxed` the 8-bit variant (`uses_relaxed_dot`), B packed by `pack_b(..., relaxed=True)`."""
    if min(spec.m, spec.n, spec.k) < 1:
        raise ValueError(f"integer GEMM dims must be positive, got {spec}")
    d = spec.dequantize
    if spec.a_zero != (at.a_zero is not None) or (spec.requantize is not None) != (at.scales is not None) \
            or spec.constant_b == (at.b_source is not None) or spec.b_zero != (at.b_zero is not None) \
            or (d is not None) != (at.dequantize_scale is not None) or (spec.requantize is not None and d is not None) \
            or (d is not None and d.bias) != (at.bias is not None) or (d is not None and d.residual) != (at.residual is not None):
        raise ValueError(f"the offsets {at} do not match {spec}")
    if relaxed and spec.b_column_span > 127:
        raise ValueError(f"B' spans {spec.b_column_span} in a column: the relaxed dot product would not be exact")
    zero_points, pack_a = render_pack_a(spec, at.a_zero if spec.a_zero else None, at.a_packed, relaxed)
    size = output_size(spec)
    per_product = [f"(local.set $abase (i32.add (i32.const {at.a}) (i32.mul (local.get $bt) (i32.const {spec.m * spec.k}))))",
                   f"(local.set $cbase (i32.add (i32.const {at.c}) (i32.mul (local.get $bt) "
                   f"(i32.const {spec.m * spec.n * size}))))"]
    if not spec.constant_b:   # this product's B into the panels the tiles read
        b_zero = f"(i32.load8_{'s' if spec.b_signed else 'u'} (i32.const {at.b_zero}))" if spec.b_zero else "(i32.const 0)"
        per_product.append(f"(call ${name}_pack_b (i32.add (i32.const {at.b_source}) (i32.mul (local.get $bt) "
                           f"(i32.const {spec.k * spec.n}))) {b_zero})")
    per_product += (pack_a + _tiles(spec, at, name, relaxed)) if relaxed else _tiles(spec, at, name, relaxed, pack_a)
    code = _scales(spec, at) + _dequantize_scale(spec, at) + zero_points + counted_loop("$bt", spec.batch, per_product)
    decls = ["(local $za i32) (local $g i32) (local $p i32) (local $pa i32) (local $pb i32) (local $pc i32)",
             "(local $bt i32) (local $abase i32) (local $cbase i32) (local $pr i32) (local $dqs v128) (local $dqf f32)",
             "(local $src i32) (local $zv v128) (local $x0 v128) (local $x1 v128) (local $x2 v128) (local $x3 v128)",
             "(local $lo v128) (local $hi v128) (local $v0 v128) (local $v1 v128) (local $szv v128) (local $n i32)",
             " ".join(f"(local $s{r} v128) (local $t{r} i32)" for r in range(ROWS))]
    q = spec.requantize
    title = (f";; C[{spec.m}x{spec.n}] = (A[{spec.m}x{spec.k}] - a_zero) @ B'[{spec.k}x{spec.n}]"
             f"{f' x {spec.batch}' if spec.batch > 1 else ''}, A {'int8' if spec.a_signed else 'uint8'}"
             f"{', relaxed dot product' if relaxed else ''}{'' if spec.constant_b else ', B packed at run time'}"
             + (f", requantised to {'int8' if q.signed_output else 'uint8'}" if q else
                ", dequantised to float32" if d else ", int32"))
    body = "\n".join([f"(func ${name}", "  " + title, *("  " + d for d in decls), *("  " + c for c in code), ")"])
    helpers = "".join(render_k_function(f"{name}_k{rows}", rows, at.tile, relaxed, broadcast_a=not relaxed)
                      for rows in sorted(tile_heights(spec.m)))
    if not spec.constant_b:
        helpers += render_pack_panels(spec.n, spec.k, spec.b_signed, at.b_packed, f"{name}_pack_b")
    return body + "\n" + helpers


def tile_heights(m: int) -> set[int]:
    return {h for h in (ROWS if m >= ROWS else 0, m % ROWS) if h}


def _scales(spec: IntegerGemmSpec, at: IntegerGemmOffsets) -> list[str]:
    """scale[j] = (a_scale * b_scale[j]) / out_scale for every column of the padded panels, in f32
    as the loop nest computes it (the padding columns repeat column N - 1's scale)."""
    q = spec.requantize
    if q is None:
        return []
    if q.b_scale_per_column:
        column = (f"(select (local.get $p) (i32.const {spec.n - 1}) (i32.lt_u (local.get $p) (i32.const {spec.n})))")
        b_scale = f"(f32.load offset={at.b_scale} (i32.shl {column} (i32.const 2)))"
    else:
        b_scale = f"(f32.load (i32.const {at.b_scale}))"
    value = f"(f32.div (f32.mul (f32.load (i32.const {at.a_scale})) {b_scale}) (f32.load (i32.const {at.out_scale})))"
    return counted_loop("$p", PANEL * panels(spec.n),
                    [f"(f32.store offset={at.scales} (i32.shl (local.get $p) (i32.const 2)) {value})"])


def _dequantize_scale(spec: IntegerGemmSpec, at: IntegerGemmOffsets) -> list[str]:
    """A per-tensor dequantising scale, read once per call into $dqf and its splat $dqs."""
    d = spec.dequantize
    if d is None or d.scale_per_column:
        return []
    return [f"(local.set $dqf (f32.load (i32.const {at.dequantize_scale})))", "(local.set $dqs (f32x4.splat (local.get $dqf)))"]


def _tiles(spec: IntegerGemmSpec, at: IntegerGemmOffsets, name: str, relaxed: bool,
           pack_group: list[str] | None = None) -> list[str]:
    """The tiles, the last group and the last panel partial. 16-bit A: row groups outside, each
    packed by `pack_group` into the one group of scratch right before the panels pass over it, so it
    is in L1 while they stream past (its 64 bytes per k pair are twice a panel's); the relaxed
    kernel's A, packed whole before: panels outside (one panel of B', K x 8 bytes, stays in L1
    while every row group passes)."""
    m, n, k = spec.m, spec.n, spec.k
    panel_bytes, a_group_bytes = steps(k, relaxed) * PANEL * 4, group_bytes(k, relaxed)
    group_a = (f"(i32.add (i32.const {at.a_packed}) (i32.mul (local.get $g) (i32.const {a_group_bytes})))" if relaxed
               else f"(i32.const {at.a_packed})")

    def tile(rows: int, cols: int) -> list[str]:
        height = ROWS if rows == ROWS else rows
        return [f"(local.set $pa {group_a})",
                f"(local.set $pb (i32.add (i32.const {at.b_packed}) (i32.mul (local.get $p) (i32.const {panel_bytes}))))",
                f"(call ${name}_k{height} (local.get $pa) (local.get $pb) (i32.add (local.get $pb) (i32.const {panel_bytes})))",
                *_epilogue(spec, at, rows, cols, relaxed)]
    return tile_grid(m, n, tile) if relaxed else tile_grid(m, n, tile, group_prologue=pack_group)


def tile_grid(m: int, n: int, tile, group_prologue: list[str] | None = None) -> list[str]:
    """The loops over an m x n result in tiles: panels of PANEL columns outside ($p), groups of ROWS
    rows inside ($g), or with a `group_prologue` (code run first for each group) the other way
    round, the last of either partial; `tile(rows, cols)` is the code of the tile at $g, $p (the
    integer Conv's channels x pixels tiles walk the same grid)."""
    full_groups, rest_rows = divmod(m, ROWS)
    full_panels, rest_cols = divmod(n, PANEL)
    if group_prologue is not None:
        def panels_of(rows: int) -> list[str]:
            code = counted_loop("$p", full_panels, tile(rows, PANEL)) if full_panels else []
            if rest_cols:
                code += [f"(local.set $p (i32.const {full_panels}))", *tile(rows, rest_cols)]
            return group_prologue + code

        code = counted_loop("$g", full_groups, panels_of(ROWS)) if full_groups else []
        if rest_rows:
            code += [f"(local.set $g (i32.const {full_groups}))", *panels_of(rest_rows)]
        return code

    def row_groups(cols: int) -> list[str]:
        code = counted_loop("$g", full_groups, tile(ROWS, cols)) if full_groups else []
        if rest_rows:
            code += [f"(local.set $g (i32.const {full_groups}))", *tile(rest_rows, cols)]
        return code

    code = counted_loop("$p", full_panels, row_groups(PANEL)) if full_panels else []
    if rest_cols:
        code += [f"(local.set $p (i32.const {full_panels}))", *row_groups(rest_cols)]
    return code


def _epilogue(spec: IntegerGemmSpec, at: IntegerGemmOffsets, rows: int, cols: int, relaxed: bool) -> list[str]:
    """The tile's `rows` x `cols` sums from the scratch tile into C at row group $g, panel $p. The
    relaxed kernel's sums are of (A - shift) and (B' - c): they become those of (A - a_zero) and B'
    by adding c * rowsum(A - shift) + (shift - a_zero) * colsum(B')."""
    q = spec.requantize

    def tile_value(r: int, v: int) -> str:
        value = f"(v128.load offset={at.tile + 32 * r + 16 * v} (i32.const 0))"
        if not relaxed:
            return value
        columns = at.b_packed + panels(spec.n) * steps(spec.k, True) * PANEL * 4 + 16 * v
        low = f"(v128.load offset={columns} (i32.shl (local.get $p) (i32.const 5)))"
        sums = f"(v128.load offset={columns + 4 * PANEL * panels(spec.n)} (i32.shl (local.get $p) (i32.const 5)))"
        row_sum = (f"(i32x4.splat (i32.load offset={at.a_packed + groups(spec.m) * steps(spec.k, True) * 16 + 4 * r} "
                   "(i32.shl (local.get $g) (i32.const 4))))")
        return f"(i32x4.add {value} (i32x4.add (i32x4.mul {low} {row_sum}) (i32x4.mul (local.get $szv) {sums})))"

    size = output_size(spec)
    row0 = f"(i32.mul (local.get $g) (i32.const {ROWS * spec.n * size}))"
    code = [f"(local.set $pc (i32.add (local.get $cbase) (i32.add {row0} (i32.mul (local.get $p) (i32.const {PANEL * size})))))"]
    if spec.dequantize is not None:
        return code + _dequantized(spec, at, rows, cols, tile_value)
    if q is None:
        return code + store_int32_tile(rows, cols, spec.n, tile_value)
    info = np.iinfo(np.int8 if q.signed_output else np.uint8)
    lo, hi = float(info.min), float(info.max)
    sign = "s" if q.signed_output else "u"
    zero = (f"(f32x4.splat (f32.convert_i32_s (i32.load8_{sign} (i32.const {at.out_zero}))))" if q.out_zero else None)
    for r in range(rows):
        for v in range(2):
            value = (f"(f32x4.mul (f32x4.convert_i32x4_s {tile_value(r, v)}) "
                     f"(v128.load offset={at.scales + 16 * v} (i32.shl (local.get $p) (i32.const {5}))))")
            value = f"(f32x4.nearest {value})"
            if zero is not None:
                value = f"(f32x4.add {value} {zero})"
            value = (f"(i32x4.trunc_sat_f32x4_s (f32x4.min (f32x4.max {value} (v128.const f32x4 {lo} {lo} {lo} {lo})) "
                     f"(v128.const f32x4 {hi} {hi} {hi} {hi})))")
            code.append(f"(local.set $v{v} {value})")
        packed = f"(i8x16.narrow_i16x8_{sign} (i16x8.narrow_i32x4_s (local.get $v0) (local.get $v1)) (local.get $v0))"
        base = r * spec.n
        if cols == PANEL:
            code.append(f"(v128.store64_lane offset={base} 0 (local.get $pc) {packed})")
        else:
            code += [f"(local.set $v0 {packed})"]
            code += [f"(i32.store8 offset={base + lane} (local.get $pc) (i8x16.extract_lane_u {lane} (local.get $v0)))"
                     for lane in range(cols)]
    return code


def store_int32_tile(rows: int, cols: int, n: int, tile_value) -> list[str]:
    """The tile's int32 sums (`tile_value(row, half)`: a v128 of 4 columns) into a row-major result
    of `n` int32 columns at $pc; the columns of a partial panel lane by lane."""
    code = []
    for r in range(rows):
        for v in range(2):
            lanes, src, base = min(4, cols - 4 * v), tile_value(r, v), r * n * 4 + 16 * v
            if lanes == 4:
                code.append(f"(v128.store offset={base} (local.get $pc) {src})")
            else:
                code += [f"(i32.store offset={base + 4 * lane} (local.get $pc) (i32x4.extract_lane {lane} {src}))"
                         for lane in range(max(lanes, 0))]
    return code


def _dequantized(spec: IntegerGemmSpec, at: IntegerGemmOffsets, rows: int, cols: int, tile_value) -> list[str]:
    """The tile as float32: float(acc) * scale, + bias, + residual, rounded after each step as the
    unfused Cast, Mul and Adds are (no fused multiply-add). Whole vectors of 4 columns as f32x4, the
    columns of a partial panel lane by lane (f32 arithmetic, the same roundings), so that no vector
    reads past the end of the per-column scale or bias."""
    d = spec.dequantize
    column = "(i32.shl (local.get $p) (i32.const 5))"   # the panel's first column, in bytes
    code = [f"(local.set $pr (i32.add (local.get $pc) (i32.const {at.residual - at.c})))"] if d.residual else []
    for r in range(rows):
        for v in range(2):
            lanes, base = min(4, cols - 4 * v), r * spec.n * 4 + 16 * v
            if lanes == 4:
                value = f"(f32x4.convert_i32x4_s {tile_value(r, v)})"
                scale = (f"(v128.load offset={at.dequantize_scale + 16 * v} {column})" if d.scale_per_column
                         else "(local.get $dqs)")
                value = f"(f32x4.mul {value} {scale})"
                if d.bias:
                    value = f"(f32x4.add {value} (v128.load offset={at.bias + 16 * v} {column}))"
                if d.residual:
                    value = f"(f32x4.add {value} (v128.load offset={base} (local.get $pr)))"
                code.append(f"(v128.store offset={base} (local.get $pc) {value})")
                continue
            for lane in range(max(lanes, 0)):
                value = f"(f32.convert_i32_s (i32x4.extract_lane {lane} {tile_value(r, v)}))"
                scale = (f"(f32.load offset={at.dequantize_scale + 16 * v + 4 * lane} {column})" if d.scale_per_column
                         else "(local.get $dqf)")
                value = f"(f32.mul {value} {scale})"
                if d.bias:
                    value = f"(f32.add {value} (f32.load offset={at.bias + 16 * v + 4 * lane} {column}))"
                if d.residual:
                    value = f"(f32.add {value} (f32.load offset={base + 4 * lane} (local.get $pr)))"
                code.append(f"(f32.store offset={base + 4 * lane} (local.get $pc) {value})")
    return code


def render_k_function(name: str, rows: int, tile: int, relaxed: bool, broadcast_a: bool = False) -> str:
    """`(func $name (param $pa $pb $pend))`: one tile of `rows` rows over the panel from $pb to
    $pend, K_UNROLL k pairs per iteration with a test between steps (which is also the tail), its
    sums stored to the tile at `tile`. With `broadcast_a` (the GEMM's 16-bit A, kernels/int8_pack_a.py)
    each row's operand is one plain load; else A holds one v128 per k pair of 4 rows (the integer
    Conv's weight, the relaxed kernel's A), a shuffle per row, or for fewer rows one 32-bit splat
    load per row."""
    accs = [f"$c{r}_{v}" for r in range(rows) for v in range(2)]
    locals_ = " ".join(f"(local {a} v128)" for a in accs) + " (local $av v128) (local $a v128) (local $b0 v128) (local $b1 v128)"

    def step() -> list[str]:
        shuffled = rows == ROWS and not broadcast_a
        code = ["(local.set $av (v128.load (local.get $pa)))"] if shuffled else []
        code += ["(local.set $b0 (v128.load (local.get $pb)))", "(local.set $b1 (v128.load offset=16 (local.get $pb)))"]
        for r in range(rows):
            splat = (f"(v128.load offset={16 * r} (local.get $pa))" if broadcast_a else
                     f"(i8x16.shuffle {shuffle_lanes(r, r, r, r)} (local.get $av) (local.get $av))" if shuffled
                     else f"(v128.load32_splat offset={4 * r} (local.get $pa))")
            code.append(f"(local.set $a {splat})")
            if relaxed:   # A's 4 int8 against B's 4 7-bit values, added to the sums (module docstring)
                code += [f"(local.set $c{r}_{v} (i32x4.add (local.get $c{r}_{v}) (i32x4.extadd_pairwise_i16x8_s "
                         f"(i16x8.relaxed_dot_i8x16_i7x16_s (local.get $a) (local.get $b{v})))))" for v in range(2)]
            else:
                code += [f"(local.set $c{r}_{v} (i32x4.add (local.get $c{r}_{v}) (i32x4.dot_i16x8_s (local.get $a) "
                         f"(local.get $b{v}))))" for v in range(2)]
        return code + [f"(local.set $pa (i32.add (local.get $pa) (i32.const {BROADCAST_PAIR_BYTES if broadcast_a else 16})))",
                       f"(local.set $pb (i32.add (local.get $pb) (i32.const {PANEL * 4})))"]

    body: list[str] = []
    for u in range(K_UNROLL):
        body += step()
        body.append("(br_if $done (i32.ge_u (local.get $pb) (local.get $pend)))" if u < K_UNROLL - 1
                    else "(br_if $k (i32.lt_u (local.get $pb) (local.get $pend)))")
    init = [f"(local.set {a} (v128.const i32x4 0 0 0 0))" for a in accs]
    stores = [f"(v128.store offset={tile + 32 * r + 16 * v} (i32.const 0) (local.get $c{r}_{v}))"
              for r in range(rows) for v in range(2)]
    lines = [f"(func ${name} (param $pa i32) (param $pb i32) (param $pend i32)", f"  {locals_}", *("  " + s for s in init),
             "  (block $done (loop $k", *("    " + s for s in body), "  ))", *("  " + s for s in stores), ")"]
    return "\n".join(lines) + "\n"
