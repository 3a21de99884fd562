"""The SIMD128 register tile of the GEMM: up to 4 rows of A times one or two 16-column panels of B.

Two loops, by how A is laid out:
- 4 rows whose A values for one k are adjacent (packed A, or A^T) and one-row tiles: passes over K
  of at most 8 accumulators each (4 rows x 2 vectors, 1 x 4), so a 4 x 16 tile is two passes over
  the same block of A and B (both in L1). Per k step a pass loads each B vector once and broadcasts
  A from one `v128.load` with an `i8x16.shuffle` per row (one `pshufd` each). Each k step ends with
  a test of `$pb` against `$pend`, which also handles any K without a tail loop;
  `TileGeometry.unroll` steps run per iteration.
- A read in place with its rows apart (no scratch to pack it into, as for the models' MatMuls):
  the whole panel in one pass, `f32.load` + `f32x4.splat` per row, UNROLL steps per iteration up to
  `$pend4`, then a one-step tail.
The multiply-add is `f32x4.relaxed_madd` (one FMA on x86) with relaxed SIMD, `f32x4.mul` +
`f32x4.add` otherwise.
With `render_tile(..., k_function=NAME)` the 4-row passes of packed A call the loop rendered as its
own functions by `render_k_functions` (unrolled 8 times, accumulating in C; an edge panel's passes
call functions rendered for their widths, `edge_pass_lanes`) and keep only the bias,
residual and activation inline: Cranelift then allocates the loop's registers alone, without the
epilogue's constants and pointers (backends/wasm/gemm.py, `_k_function_unroll`, has the figures).

Why this shape, from the machine code wasmtime 50 (Cranelift) produces on an AMD EPYC Zen 4 (16 xmm
registers, 2 FMA pipes), read with `objdump -d` on `wasmtime.Module(...).serialize()`:
- Cranelift places a pure instruction (the FMA, the splat) right before its first use by a
  side-effecting one. Loads are side-effecting and the loop's back-edge is the only user of the
  accumulators, so every load of an iteration comes first and every FMA after it: all loaded values
  and all accumulators are live at once. The old 4 x 16 tile unrolled twice (16 accumulators +
  8 splats + 8 B vectors) spilled on every step. A branch that carries the accumulators (the
  `$pend` test between steps) forces each step's FMAs before the next step's loads.
- A load can be folded into the instruction that uses it only when no other side effect lies
  between them, so in such a loop only the last load of a step could become a memory operand; B
  read straight from memory once per multiply-add (distinct pointers per row) left 16 loaded
  vectors live and ran at 15 GFLOP/s.
- `fma x y z` becomes `vfmadd213ps`, which overwrites x: the result lands in x's register, so x is
  copied when it has later uses (x is whichever of the splat and the B vector has fewer uses; the
  splat on a tie), and
  the loop's back-edge moves every accumulator back to its register: 8 moves per iteration.
  Unrolling shares those moves between steps.
- 8 accumulators with the 4-cycle FMA latency and 2 pipes are exactly enough to keep the pipes busy,
  so a spill on an accumulator's chain (a store and a reload in its dependency chain) costs a few
  cycles on every step. Whether the unrolled loop spills depends on Cranelift's register allocator
  and the code around the loop (constants of an activation, a bias): see `_unroll` in
  backends/wasm/gemm.py for the measurements behind the choice.

Measured (relaxed SIMD, A packed, CPU time, median; FMA loop peak in the same run 57-58 GFLOP/s):
one tile's loop alone over a K = 128 block in L1: 4 x 16 unrolled twice 39, 4 x 8 one step per
iteration 42, 4 x 8 with the `$pend` test between 4 steps 48-49, the same with per-row `f32.load`
splats 37, with `v128.load32_splat` 37, with mul + add instead of FMA 39, 3 x 16 or 4 x 12
(spilling) 27. The whole GEMM, `python -m bench.gemm_bench` (GFLOP/s, the kernel before these passes
-> now, two runs each; peaks: wasmtime FMA 56-57, mul+add 45, V8 FMA 58):
  shape        wasmtime (FMA)      wasmtime (mul+add)   V8 (Node 20, FMA)
  64^3         35.2-35.5 -> 38.2   31.3-32.4 -> 36.7    37.8-38.7 -> 50.5
  256^3        34.9-37.3 -> 43.8   30.9-32.5 -> 37.4    37.0-38.0 -> 47.0-49.8
  512^3        35.0-36.0 -> 41.8   30.2-31.6 -> 35.6    34.4-36.1 -> 46.5-46.9
  1024^3       34.4-34.7 -> 42.5   28.9-30.3 -> 36.7    33.2-33.6 -> 46.4-47.0
  1x3072x768   17.3-20.1 -> 25.3   18.7-21.0 -> 29.8    21.7-23.0 -> 27.7-28.7
Then with the k loop as a function of its own (relaxed SIMD; one run of `python -m bench.gemm_bench
--rounds 3`, peaks wasmtime FMA 58.0, V8 59.6): wasmtime 64^3 47.8, 256^3 48.9, 512^3 46.3,
1024^3 48.2, 1x3072x768 27.6 (GEMV: not this path); V8 50.7, 53.1, 48.7, 48.0, 29.0. V8 does not
lose from the call either.

The caller (backends/wasm/gemm.py) sets these i32 locals before the tile: `$pa` (A at row i, k0,
or the row group in packed A), `$pb` (packed B at panel j, k0), `$pc` (C at row i, column 16 j),
`$pr` (residual, same place), `$pbias` (bias at column 16 j, or at row i with per-row bias), `$pend`
(where `$pb` stops), `$pend4` (where `$pb` stops for the loop unrolled UNROLL times) and `$first` /
`$last` (whether this is the first / last K block). The tile moves `$pa` and `$pb`.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.wasm.kernels.activation import v128_activation
from backends.wasm.simd_lanes import shuffle_lanes

PANEL = 16          # columns per packed B panel
PANEL_BYTES = PANEL * 4
MAX_ROWS = 4
UNROLL = 2  # k steps per iteration of `_k_loop_row_by_row`: callers set $pend4 = $pb + (klen & -UNROLL) * 64
UNROLLS = (1, 2, 4, 8)  # TileGeometry.unroll: k steps per loop iteration
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
    unroll: int = 1         # k steps per loop iteration, one of UNROLLS (see the module docstring)


def acc(r: int, v: int) -> str:
    return f"$c{r}_{v}"


def tile_locals() -> list[str]:
    regs = " ".join(f"(local {acc(r, v)} v128)" for r in range(MAX_ROWS) for v in range(8))
    splats = " ".join(f"(local $a{r} v128)" for r in range(MAX_ROWS))
    b_vectors = " ".join(f"(local $b{v} v128)" for v in range(PANEL // 4))
    return [regs, f"{splats} {b_vectors} (local $av v128) (local $bv v128) (local $tile_pa i32) (local $tile_pb i32)"]


def render_tile(rows: int, vecs: list[Vec], g: TileGeometry, k_function: str | None = None) -> list[str]:
    """The tile's code. With `k_function` (the name given to `render_k_functions`, whose functions
    must be in the module), the passes that fit them (4 rows of packed A, 2 whole vectors) call them
    for their k loop and keep only the epilogue inline; the other passes run as without."""
    assert 1 <= rows <= MAX_ROWS and vecs and g.unroll in UNROLLS
    passes = _column_passes(rows, vecs, g)
    code: list[str] = []
    called = [bool(k_function) and _fits_k_function(rows, part, g) for part in passes]
    moved = False  # whether an inline pass has moved $pa and $pb: every pass walks K from the tile's start
    if not all(called[:-1]):
        code += ["(local.set $tile_pa (local.get $pa))", "(local.set $tile_pb (local.get $pb))"]
    for part, is_called in zip(passes, called):
        if moved:
            code += ["(local.set $pa (local.get $tile_pa))", "(local.set $pb (local.get $tile_pb))"]
        code += _called_pass(part, g, k_function) if is_called else _pass(rows, part, g)
        moved = not is_called
    return code


# B vectors per pass over K, by tile height, when A is broadcast from one v128 (and for one row):
# 8 accumulators, except that one row keeps 4 (its 8 B vectors per step would be live with 8
# accumulators and the splat: 17 values; measured GEMV 1x768x768 with a bias, wasmtime: 8 vectors
# 16.8 GFLOP/s, 4 vectors 26.4). Rows read one by one run the whole panel in one pass.
PASS_VECTORS = {1: 4, 2: 4, 3: 2, 4: 2}


def _one_load_a(rows: int, g: TileGeometry) -> bool:
    """Whether the tile's A values for one k are one v128 (4 rows 4 bytes apart: packed A, or A^T)."""
    return rows == MAX_ROWS and g.a_row_step == 4


def _column_passes(rows: int, vecs: list[Vec], g: TileGeometry) -> list[list[Vec]]:
    """The tile's vectors in runs of PASS_VECTORS[rows] (whole panels when A is read row by row)."""
    width = PASS_VECTORS[rows] if rows == 1 or _one_load_a(rows, g) else PANEL // 4
    return [vecs[i:i + width] for i in range(0, len(vecs), width)]


def _pass(rows: int, vecs: list[Vec], g: TileGeometry) -> list[str]:
    code: list[str] = []
    init = _init(rows, vecs, g)
    reload = [f"(local.set {acc(r, v)} {_load('$pc', r * g.c_row_step + vec.c_offset, vec.lanes)})"
              for r in range(rows) for v, vec in enumerate(vecs)]
    code += _branch(g.static_first, "$first", init, reload)
    code += _k_loop(rows, vecs, g) if rows == 1 or _one_load_a(rows, g) else _k_loop_row_by_row(rows, vecs, g)
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
    return [f"(local.set {acc(r, v)} {_init_value(r, vec, g)})" for r in range(rows) for v, vec in enumerate(vecs)]


def _init_value(r: int, vec: Vec, g: TileGeometry) -> str:
    if not g.has_bias:
        value = ZERO
    elif g.bias_per_row:
        value = f"(f32x4.splat (f32.load offset={4 * r} (local.get $pbias)))"
    else:
        value = _load("$pbias", vec.c_offset, vec.lanes)
    if g.has_residual:
        res = _load("$pr", r * g.c_row_step + vec.c_offset, vec.lanes)
        value = res if not g.has_bias else f"(f32x4.add {value} {res})"
    return value


# The k loop as a function of its own (`render_k_functions`): Cranelift allocates registers per
# function and does not inline, so nothing the epilogue needs (its constants, the bias and residual
# pointers) is live around the loop, and the loop runs unrolled without spills whatever the epilogue.
# The passes it serves: 4 rows of packed A times 2 whole vectors, or times 1 vector of any width (an
# edge panel's last); the function starts from zero or from the tile in C and leaves the sums in C,
# where the epilogue (still in L1) finishes them.
K_FUNCTION_VECTORS = 2


def _fits_k_function(rows: int, vecs: list[Vec], g: TileGeometry) -> bool:
    return (_one_load_a(rows, g) and len(vecs) <= K_FUNCTION_VECTORS and all(v.lanes == 4 for v in vecs[:-1])
            and all(v.panel == vecs[0].panel and v.index == vecs[0].index + n for n, v in enumerate(vecs)))


def _k_function_name(k_function: str, lanes: tuple[int, ...]) -> str:
    return k_function if lanes == (4,) * K_FUNCTION_VECTORS else f"{k_function}_{''.join(map(str, lanes))}"


def edge_pass_lanes(columns: int) -> list[tuple[int, ...]]:
    """The column widths of the passes of a 4-row tile over an edge panel of `columns` columns that
    are not whole pairs of vectors: what `render_k_functions` needs as `edge_lanes`."""
    lanes = [min(4, columns - 4 * v) for v in range(-(-columns // 4))]
    passes = [tuple(lanes[i:i + K_FUNCTION_VECTORS]) for i in range(0, len(lanes), K_FUNCTION_VECTORS)]
    return [p for p in passes if p != (4,) * K_FUNCTION_VECTORS]


def render_k_functions(name: str, g: TileGeometry, unroll: int, edge_lanes: list[tuple[int, ...]] = ()) -> str:
    """`(func $NAME_zero)` and `(func $NAME_acc)`, both (param $pa $pb $pc $pend): one pass of a 4-row
    tile over K from $pb to $pend, `unroll` steps per iteration, adding A @ B to zero / to the 4 x 8
    tile at $pc, and storing the sums at $pc. For each tuple of vector widths in `edge_lanes` (see
    `edge_pass_lanes`), the same for a tile of those vectors, `$NAME_{widths}_zero` / `_acc`."""
    assert unroll in UNROLLS and unroll % 2 == 0 and _one_load_a(MAX_ROWS, g)
    return "".join(_k_function(_k_function_name(name, lanes), g, unroll, [Vec(0, v, n) for v, n in enumerate(lanes)])
                   for lanes in [(4,) * K_FUNCTION_VECTORS, *edge_lanes])


def _k_function(name: str, g: TileGeometry, unroll: int, vecs: list[Vec]) -> str:
    rows = MAX_ROWS
    loop_g = TileGeometry(g.k, g.a_k_step, g.a_row_step, g.c_row_step, False, False, False, None, g.fma,
                          None, None, unroll)
    # One vector has 4 accumulators, too few to cover the multiply-add's latency: even and odd k
    # steps go to two sets (acc(r, 0), acc(r, 1)), added at the end.
    split = len(vecs) == 1
    sets = 2 if split else len(vecs)
    locals_ = (" ".join(f"(local {acc(r, v)} v128)" for r in range(rows) for v in range(sets))
               + " " + " ".join(f"(local $a{r} v128)" for r in range(rows))
               + " " + " ".join(f"(local $b{v} v128)" for v in range(len(vecs))) + " (local $av v128) (local $bv v128)")
    loop = _k_loop_split(rows, vecs[0], loop_g) if split else _k_loop(rows, vecs, loop_g)
    funcs = []
    for suffix, start_from_c in (("zero", False), ("acc", True)):
        init = [f"(local.set {acc(r, v)} {_load('$pc', r * g.c_row_step + vec.c_offset, vec.lanes) if start_from_c else ZERO})"
                for r in range(rows) for v, vec in enumerate(vecs)]
        if split:
            init += [f"(local.set {acc(r, 1)} {ZERO})" for r in range(rows)]
            init_sum = [f"(local.set {acc(r, 0)} (f32x4.add (local.get {acc(r, 0)}) (local.get {acc(r, 1)})))" for r in range(rows)]
        else:
            init_sum = []
        stores = [line for r in range(rows) for v, vec in enumerate(vecs)
                  for line in _store("$pc", r * g.c_row_step + vec.c_offset, vec.lanes, acc(r, v))]
        body = init + loop + init_sum + stores
        funcs.append("\n".join([f"(func ${name}_{suffix} (param $pa i32) (param $pb i32) (param $pc i32) (param $pend i32)",
                                 f"  {locals_}", *("  " + line for line in body), ")"]) + "\n")
    return "".join(funcs)


def _k_loop_split(rows: int, vec: Vec, g: TileGeometry) -> list[str]:
    """`_k_loop` for one vector, even steps into acc(r, 0), odd ones into acc(r, 1)."""
    steps = []
    for u in range(g.unroll):
        step = ["(local.set $av (v128.load (local.get $pa)))",
                *(f"(local.set $a{r} (i8x16.shuffle {_lane_splat(r)} (local.get $av) (local.get $av)))" for r in range(rows)),
                f"(local.set $b0 (v128.load offset={vec.index * 16} (local.get $pb)))"]
        for r in range(rows):
            x, y, c = f"(local.get $a{r})", "(local.get $b0)", f"(local.get {acc(r, u % 2)})"
            madd = f"(f32x4.relaxed_madd {x} {y} {c})" if g.fma else f"(f32x4.add (f32x4.mul {x} {y}) {c})"
            step.append(f"(local.set {acc(r, u % 2)} {madd})")
        steps.append(step)
    return _stepped_k_loop(steps, g)


def _called_pass(vecs: list[Vec], g: TileGeometry, k_function: str) -> list[str]:
    """A pass whose k loop is a call of `render_k_functions`' function: on the first K block the
    bias and residual go into C first (or the loop starts from zero), after the last the activation
    runs over the tile in C."""
    rows, first = MAX_ROWS, vecs[0]
    b_shift, c_shift = first.panel * g.k * PANEL_BYTES + first.index * 16, first.c_offset
    function = _k_function_name(k_function, tuple(v.lanes for v in vecs))

    def shifted(ptr: str, by: int) -> str:
        return f"(i32.add (local.get {ptr}) (i32.const {by}))" if by else f"(local.get {ptr})"

    args = f"(local.get $pa) {shifted('$pb', b_shift)} {shifted('$pc', c_shift)} {shifted('$pend', b_shift)}"
    call_acc = [f"(call ${function}_acc {args})"]
    if g.has_bias or g.has_residual:
        first_block = []
        for r in range(rows):
            for v, vec in enumerate(vecs):
                first_block += [f"(local.set {acc(r, v)} {_init_value(r, vec, g)})",
                                *_store("$pc", r * g.c_row_step + vec.c_offset, vec.lanes, acc(r, v))]
        first_block += call_acc
    else:
        first_block = [f"(call ${function}_zero {args})"]
    code = _branch(g.static_first, "$first", first_block, call_acc)
    act = []
    if g.epilogue is not None:
        for r in range(rows):
            for v, vec in enumerate(vecs):
                at = r * g.c_row_step + vec.c_offset
                act += [f"(local.set {acc(r, v)} {_load('$pc', at, vec.lanes)})",
                        *v128_activation(g.epilogue, acc(r, v)),
                        *_store("$pc", at, vec.lanes, acc(r, v))]
    return code + _branch(g.static_last, "$last", act, [])


def _k_loop(rows: int, vecs: list[Vec], g: TileGeometry) -> list[str]:
    """g.unroll k steps per iteration, each followed by a test of $pb against $pend: the test is the
    tail (no second loop), and it is what keeps each step's loads next to its multiply-adds (Cranelift
    places pure instructions at their first use, so without a branch between steps every load of the
    iteration would come first and stay live)."""
    return _stepped_k_loop([_k_step(rows, vecs, g) for _ in range(g.unroll)], g)


def _stepped_k_loop(steps: list[list[str]], g: TileGeometry) -> list[str]:
    """The k loop around `steps` (one list of lines per k step of an iteration): each step moves $pa
    and $pb on by one k and, but for the last, leaves the loop when $pb reaches $pend."""
    body: list[str] = []
    for u, step in enumerate(steps):
        body += step
        body += [f"(local.set $pa (i32.add (local.get $pa) (i32.const {g.a_k_step})))",
                 f"(local.set $pb (i32.add (local.get $pb) (i32.const {PANEL_BYTES})))"]
        if u < len(steps) - 1:
            body.append("(br_if $tile_kdone (i32.ge_u (local.get $pb) (local.get $pend)))")
    body.append("(br_if $tile_k (i32.lt_u (local.get $pb) (local.get $pend)))")
    return [
        "(if (i32.lt_u (local.get $pb) (local.get $pend))",
        "  (then (block $tile_kdone (loop $tile_k",
        *("    " + s for s in body),
        "  ))))",
    ]


def _k_loop_row_by_row(rows: int, vecs: list[Vec], g: TileGeometry) -> list[str]:
    """A read one row at a time (its rows apart in memory): the loop of the kernel before the passes,
    UNROLL steps per iteration up to $pend4, then one step at a time. Measured against `_k_loop`
    on such A (wasmtime, relaxed SIMD, bias, GFLOP/s): 512^3 36.9 vs 34.1, 128x384x384 36.5 vs 35.0."""
    unrolled = [line for u in range(UNROLL) for line in _k_step(rows, vecs, g, u)]
    return [
        "(if (i32.lt_u (local.get $pb) (local.get $pend4))",
        "  (then (loop $tile_kn",
        *("    " + s for s in unrolled),
        f"    (local.set $pa (i32.add (local.get $pa) (i32.const {UNROLL * g.a_k_step})))",
        f"    (local.set $pb (i32.add (local.get $pb) (i32.const {UNROLL * PANEL_BYTES})))",
        "    (br_if $tile_kn (i32.lt_u (local.get $pb) (local.get $pend4))))))",
        "(if (i32.lt_u (local.get $pb) (local.get $pend))",
        "  (then (loop $tile_k1",
        *("    " + s for s in _k_step(rows, vecs, g, 0)),
        f"    (local.set $pa (i32.add (local.get $pa) (i32.const {g.a_k_step})))",
        f"    (local.set $pb (i32.add (local.get $pb) (i32.const {PANEL_BYTES})))",
        "    (br_if $tile_k1 (i32.lt_u (local.get $pb) (local.get $pend))))))",
    ]


def _k_step(rows: int, vecs: list[Vec], g: TileGeometry, u: int = 0) -> list[str]:
    """One k step at $pa / $pb plus u steps (offsets)."""
    a_at, b_at = u * g.a_k_step, u * PANEL_BYTES
    if _one_load_a(rows, g):  # one load, then a shuffle per row
        code = [f"(local.set $av (v128.load offset={a_at} (local.get $pa)))"]
        code += [f"(local.set $a{r} (i8x16.shuffle {_lane_splat(r)} (local.get $av) (local.get $av)))" for r in range(rows)]
    else:
        code = [f"(local.set $a{r} (f32x4.splat (f32.load offset={a_at + r * g.a_row_step} (local.get $pa))))"
                for r in range(rows)]
    # Cranelift's FMA overwrites its first multiplicand: put first the operand with fewer uses
    b_first = rows < len(vecs)
    b_at_v = [vec.panel * g.k * PANEL_BYTES + vec.index * 16 + b_at for vec in vecs]

    def madd(r: int, v: int, b: str) -> str:
        a, c = f"(local.get $a{r})", f"(local.get {acc(r, v)})"
        x, y = (b, a) if b_first else (a, b)
        if g.fma:
            return f"(local.set {acc(r, v)} (f32x4.relaxed_madd {x} {y} {c}))"
        return f"(local.set {acc(r, v)} (f32x4.add (f32x4.mul {x} {y}) {c}))"

    if u == 0 and (rows == 1 or _one_load_a(rows, g)):
        # Row by row, so that one row's splat is live at a time: Cranelift computes the FMAs in the
        # order the accumulators are first used. Vector by vector, all 4 splats were live and a 1x1
        # Conv 64->16 at 56x56 (implicit GEMM, bias, relu) spilled an accumulator on every step:
        # 17.8 GFLOP/s, row by row 30.8 (wasmtime, relaxed SIMD; the kernel before the passes: 25.4).
        code += [f"(local.set $b{v} (v128.load offset={off} (local.get $pb)))" for v, off in enumerate(b_at_v)]
        return code + [madd(r, v, f"(local.get $b{v})") for r in range(rows) for v in range(len(vecs))]
    for v, off in enumerate(b_at_v):
        code.append(f"(local.set $bv (v128.load offset={off} (local.get $pb)))")
        code += [madd(r, v, "(local.get $bv)") for r in range(rows)]
    return code


def _lane_splat(lane: int) -> str:
    return shuffle_lanes(lane, lane, lane, lane)


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
