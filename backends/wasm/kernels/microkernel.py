"""The SIMD128 register tile of the GEMM: up to 4 rows of A times one or two 16-column panels of B.

A tile keeps its block of C in v128 locals for a whole K block (4 rows x 4 vectors = 16 accumulators).
Per k step it broadcasts each row's A value with `f32.load` + `f32x4.splat` (cheaper under Cranelift
than `v128.load32_splat`, which it lowers to a load, a movd and a shuffle), then loads each B vector
once and issues one multiply-add per row with it: `f32x4.relaxed_madd` (one FMA on x86) when relaxed
SIMD is on, `f32x4.mul` + `f32x4.add` otherwise. The k loop is unrolled by `UNROLL` with a one-step
tail.

Measured on an AMD EPYC (relaxed SIMD, A packed, CPU time), GFLOP/s at 512^3 against a 56-58 FMA
loop peak: this order with 4 rows, wasmtime 50: 37, V8 (Node 20): 37; with 3 rows 35 and 38. Going
row by row instead (one splat live, B reloaded per row) gives wasmtime 39 (Cranelift merges the
repeated B loads and spills less) but V8 18 (it reloads B for every row), so this order is the one
that is fast on both engines. Cranelift lowers FMA writing over a multiplicand, so each multiply-add
also costs a register copy: that, not the FMA units, is what keeps a tile under peak.

The caller (backends/wasm/gemm.py) sets these i32 locals before the tile: `$pa` (A at row i, k0,
or the row group in packed A), `$pb` (packed B at panel j, k0), `$pc` (C at row i, column 16 j),
`$pr` (residual, same place), `$pbias` (bias at column 16 j, or at row i with per-row bias), `$pend`
and `$pend4` (where `$pb` stops, for the whole block and for the unrolled part), `$first` / `$last`
(whether this is the first / last K block).
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.wasm.kernels.activation import v128_activation

PANEL = 16          # columns per packed B panel
PANEL_BYTES = PANEL * 4
MAX_ROWS = 4
# k steps per loop iteration. Measured under wasmtime (Cranelift), 512^3: unroll 1: 26 GFLOP/s,
# 2: 33-39, 4: 28-31, 8: 18 (longer bodies only add spills).
UNROLL = 2  # a power of two: the unrolled part ends at klen & -UNROLL
ZERO = "(v128.const f32x4 0 0 0 0)"


@dataclass(frozen=True)
class Vec:
    """One v128 column group of the tile: panel `panel` (0 or 1, relative to j), vector `index`
    (0..3) inside it, and how many of its 4 lanes are real columns (the edge panel has fewer)."""
    panel: int
    index: int
    lanes: int = 4

    @property
    def c_offset(self) -> int:
        return self.panel * PANEL_BYTES + self.index * 16


@dataclass(frozen=True)
class TileGeometry:
    """What is fixed at compile time for every tile of one GEMM."""
    k: int                  # full K (the distance between B panels is k * PANEL_BYTES)
    a_k_step: int           # bytes between A[i, k] and A[i, k + 1]
    a_row_step: int         # bytes between A[i, k] and A[i + 1, k]
    c_row_step: int         # bytes between C rows (the residual has the same layout)
    has_bias: bool
    bias_per_row: bool      # bias holds M floats (one per row: Conv's output channels) instead of N
    has_residual: bool
    epilogue: str | None
    fma: bool               # relaxed SIMD multiply-add
    static_first: bool | None  # True/False when every tile is the first/last block, None: runtime
    static_last: bool | None


def acc(r: int, v: int) -> str:
    return f"$c{r}_{v}"


def tile_locals() -> list[str]:
    regs = " ".join(f"(local {acc(r, v)} v128)" for r in range(MAX_ROWS) for v in range(8))
    splats = " ".join(f"(local $a{r} v128)" for r in range(MAX_ROWS))
    return [regs, f"{splats} (local $bv v128)"]


def render_tile(rows: int, vecs: list[Vec], g: TileGeometry) -> list[str]:
    assert 1 <= rows <= MAX_ROWS and vecs
    code: list[str] = []
    init = _init(rows, vecs, g)
    reload = [f"(local.set {acc(r, v)} {_load('$pc', r * g.c_row_step + vec.c_offset, vec.lanes)})"
              for r in range(rows) for v, vec in enumerate(vecs)]
    code += _branch(g.static_first, "$first", init, reload)
    code += _k_loops(rows, vecs, g)
    act = [line for r in range(rows) for v in range(len(vecs)) for line in v128_activation(g.epilogue, acc(r, v))]
    code += _branch(g.static_last, "$last", act, [])
    for r in range(rows):
        for v, vec in enumerate(vecs):
            code += _store("$pc", r * g.c_row_step + vec.c_offset, vec.lanes, acc(r, v))
    return code


def _branch(static: bool | None, flag: str, then: list[str], otherwise: list[str]) -> list[str]:
    if static is True:
        return then
    if static is False:
        return otherwise
    if not then and not otherwise:
        return []
    code = [f"(if (local.get {flag})", "  (then", *("    " + t for t in then), "  )"]
    if otherwise:
        code += ["  (else", *("    " + t for t in otherwise), "  )"]
    return code + [")"]


def _init(rows: int, vecs: list[Vec], g: TileGeometry) -> list[str]:
    """First K block: start from the bias (broadcast over rows) plus the residual. Reading the residual
    here, before any store to this tile, is what lets the residual alias C."""
    code = []
    for r in range(rows):
        for v, vec in enumerate(vecs):
            if not g.has_bias:
                value = ZERO
            elif g.bias_per_row:
                value = f"(f32x4.splat (f32.load offset={4 * r} (local.get $pbias)))"
            else:
                value = _load("$pbias", vec.c_offset, vec.lanes)
            if g.has_residual:
                res = _load("$pr", r * g.c_row_step + vec.c_offset, vec.lanes)
                value = res if not g.has_bias else f"(f32x4.add {value} {res})"
            code.append(f"(local.set {acc(r, v)} {value})")
    return code


def _k_loops(rows: int, vecs: list[Vec], g: TileGeometry) -> list[str]:
    unrolled = [line for u in range(UNROLL) for line in _k_step(rows, vecs, g, u)]
    single = _k_step(rows, vecs, g, 0)
    return [
        "(if (i32.lt_u (local.get $pb) (local.get $pend4))",
        "  (then (loop $kn",
        *("    " + s for s in unrolled),
        f"    (local.set $pa (i32.add (local.get $pa) (i32.const {UNROLL * g.a_k_step})))",
        f"    (local.set $pb (i32.add (local.get $pb) (i32.const {UNROLL * PANEL_BYTES})))",
        "    (br_if $kn (i32.lt_u (local.get $pb) (local.get $pend4))))))",
        "(if (i32.lt_u (local.get $pb) (local.get $pend))",
        "  (then (loop $k1",
        *("    " + s for s in single),
        f"    (local.set $pa (i32.add (local.get $pa) (i32.const {g.a_k_step})))",
        f"    (local.set $pb (i32.add (local.get $pb) (i32.const {PANEL_BYTES})))",
        "    (br_if $k1 (i32.lt_u (local.get $pb) (local.get $pend))))))",
    ]


def _k_step(rows: int, vecs: list[Vec], g: TileGeometry, u: int) -> list[str]:
    code = [f"(local.set $a{r} (f32x4.splat (f32.load offset={u * g.a_k_step + r * g.a_row_step} (local.get $pa))))"
            for r in range(rows)]
    for v, vec in enumerate(vecs):
        b_off = vec.panel * g.k * PANEL_BYTES + vec.index * 16 + u * PANEL_BYTES
        code.append(f"(local.set $bv (v128.load offset={b_off} (local.get $pb)))")
        for r in range(rows):
            a, c = f"(local.get $a{r})", f"(local.get {acc(r, v)})"
            if g.fma:
                code.append(f"(local.set {acc(r, v)} (f32x4.relaxed_madd {a} (local.get $bv) {c}))")
            else:
                code.append(f"(local.set {acc(r, v)} (f32x4.add (f32x4.mul {a} (local.get $bv)) {c}))")
    return code


def _load(ptr: str, offset: int, lanes: int) -> str:
    if lanes == 4:
        return f"(v128.load offset={offset} (local.get {ptr}))"
    value = ZERO
    for lane in range(lanes):  # an edge vector: never read past the last real column
        value = f"(f32x4.replace_lane {lane} {value} (f32.load offset={offset + 4 * lane} (local.get {ptr})))"
    return value


def _store(ptr: str, offset: int, lanes: int, reg: str) -> list[str]:
    if lanes == 4:
        return [f"(v128.store offset={offset} (local.get {ptr}) (local.get {reg}))"]
    return [f"(f32.store offset={offset + 4 * lane} (local.get {ptr}) (f32x4.extract_lane {lane} (local.get {reg})))"
            for lane in range(lanes)]
