"""GEMM for the WebAssembly backend: C = epilogue(A @ B + bias + residual), as one WAT function.

MatMul, Gemm and Conv (after im2col) lower to this. B, when it is a weight, is packed at compile time
into panels of 16 columns (`pack_b`) that go into a data segment; when it is an activation, the
module packs it at run time with the function `kernels/pack_b.py`'s `render_pack_b` returns. Everything else (shapes,
offsets, strides) is a compile-time constant baked into the code.

Entry points
- `pack_b(b, trans_b=False) -> bytes`: B (K x N, or N x K with trans_b) as float32 panels
  `[ceil(N/16)][K][16]`, the last panel zero-padded; `packed_b_size(k, n)` is its length.
- `render_gemm(spec, at, *, features=SIMD_FMA, layout=GemmLayout(), name="gemm") -> str`: the
  `GemmSpec` (shapes, `trans_a`, batch, the epilogue) at the byte offsets `at` (`GemmOffsets`,
  kernels/operands.py), laid out as `layout` says (`GemmLayout`: row strides, batch strides, a
  per-row bias, the tile height, A packed at compile time, a run-time shift of C), as a
  `(func $name)` with no parameters (one i32, `$c_shift`, with `layout.c_shift`) or results that
  reads and writes memory 0, followed by the functions it calls (`$name_k_zero`, `$name_k_acc`:
  the tiles' k loop, see `_k_function_unroll`) when it uses them.
  - A is M x K row-major; with `trans_a` it is stored K x M, as Gemm's transA means.
  - C and the residual are M x N. The bias is N floats broadcast over rows (M over columns with
    `bias_per_row`). The activation is None, "relu" or "gelu" (erf form), applied after bias and
    residual: C = activation(A @ B + bias + residual).
  - `features`: a set of "simd", "relaxed-simd". With relaxed SIMD the inner product uses
    `f32x4.relaxed_madd` (the host must enable relaxed SIMD; results may differ from mul+add in the
    last bit, as FMA does); with only "simd" it uses mul + add; with neither, scalar f32 code.
- A constant B stored bf16, fp16 or int8 (`spec.b_format`; SIMD, one batch, `at.a_scratch` given) is
  read from `kernels/narrow_panels.py`'s panels: before the row tiles of a panel's K block run, the
  block is widened to float32 (int8: times its column scales, which follow the panels) into the
  scratch after A's block, and the tiles read it there as they read float32 panels.
- `pack_a(a, tile_rows=4) -> np.ndarray`: A (M x K) in the order the tiles read packed A: for each
  K block of 128, groups of `tile_rows` rows (the last zero-padded) as [k][row]; `packed_a_size(m, k)`
  is its length in bytes.
- `kernels/pack_b.py` `render_pack_b(k, n, *, src_offset, dst_offset, ...)`: the run-time packing of
  a B that lives in memory into this panel layout.

Conv lowers to this through `backends/wasm/kernels/conv.py` (`render_conv2d`): im2col packed straight
into panels, the weight as A (as `pack_a` packed it at compile time where the kernel reads A packed),
the NCHW output as C with a per-row bias.

Blocking: where C is larger than L2, column chunks of about 256 KiB of C (`_chunk_panels`)
(outermost), each over every K block before the next; the loops run K blocks of 128
(`k_block_size`: all of K below 160), then row blocks of `M_BLOCK`, then 16-column panels, then
4-row tiles, so one K block of a panel (8 KiB) stays in L1 while every row tile streams past it; a 4-row tile runs as
two passes of 4 x 8 over it (kernels/microkernel.py), with relaxed SIMD each pass's k loop a call
of a function of its own, so that the epilogue around it costs the loop no registers. With one row (GEMV, bandwidth-bound) there is
no K blocking.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass


from backends.wasm.kernels.activation import (
    check_epilogue,
    f32_activation,
    scratch_locals,
)
from backends.wasm.kernels.microkernel import (
    MAX_ROWS,
    PANEL,
    PANEL_BYTES,
    UNROLL,
    TileGeometry,
    Vec,
    edge_pass_lanes,
    render_k_functions,
    render_tile,
    tile_locals,
)
# The packings are part of this module's API: kernels/gemm_packing.py holds them.
from backends.wasm.kernels.gemm_packing import (K_BLOCK, TILE_ROWS, k_block_size, pack_a, pack_b,  # noqa: F401
                                                packed_a_size, packed_b_size, packs_a)
from backends.wasm.kernels.block_quant_panels import BLOCK_WIDENING_LOCALS, render_block_quant_widening
from backends.wasm.kernels.narrow_panels import WIDENING_LOCALS, narrow_panel_bytes, render_widened_block
from backends.wasm.kernels.operands import GemmLayout, GemmOffsets
from backends.wasm.kernels.wat_loops import counted_range, wat_function
from backends.wasm.simd_lanes import shuffle_lanes
from ir.loops.contraction import GemmSpec

SCALAR: frozenset[str] = frozenset()
SIMD: frozenset[str] = frozenset({"simd"})
SIMD_FMA: frozenset[str] = frozenset({"simd", "relaxed-simd"})
KNOWN_FEATURES = SIMD_FMA
M_BLOCK = 240
# B in MatMulNBits' blocks (kernels/block_quant.py `pack_block_quant_panels`, `GemmLayout.b_block`):
# format -> bits of a code
BLOCK_FORMATS = {"q4": 4, "q8": 8}  # a multiple of the 4-row tile: only the last row block has a short tile


def _check_features(features) -> frozenset[str]:
    features = frozenset(features)
    unknown = features - KNOWN_FEATURES
    if unknown:
        raise ValueError(f"unknown WebAssembly features {sorted(unknown)}; known: {sorted(KNOWN_FEATURES)}")
    if "relaxed-simd" in features and "simd" not in features:
        raise ValueError("relaxed-simd needs simd")
    return features


def render_gemm(spec: GemmSpec, at: GemmOffsets, *, features=SIMD_FMA, layout: GemmLayout = GemmLayout(),
                name: str = "gemm") -> str:
    m, n, k, batch, trans_a, epilogue = spec.m, spec.n, spec.k, spec.batch, spec.trans_a, spec.epilogue.activation
    tile_rows = layout.tile_rows if layout.tile_rows is not None else TILE_ROWS
    features = _check_features(features)
    check_epilogue(epilogue)
    if spec.epilogue.bias != (at.bias is not None) or spec.epilogue.residual != (at.residual is not None):
        raise ValueError(f"the epilogue {spec.epilogue} needs exactly its bias and residual offsets, got {at}")
    if not 1 <= tile_rows <= MAX_ROWS:
        raise ValueError(f"tile_rows must be 1..{MAX_ROWS}, got {tile_rows}")
    if min(m, n, k, batch) < 1:
        raise ValueError(f"GEMM dims must be positive, got m={m} n={n} k={k} batch={batch}")
    if layout.a_packed and (trans_a or layout.lda or not packs_a(m, features, tile_rows)):
        raise ValueError(f"a packed A needs SIMD, more than {tile_rows} rows and no transA/lda (m={m})")
    if spec.b_format != "f32" and ("simd" not in features or batch > 1 or at.a_scratch is None or layout.a_packed):
        raise ValueError(f"a {spec.b_format} B needs SIMD, one batch and the kernel's scratch (batch={batch})")
    lda = layout.lda or (m if trans_a else k)
    ldc = layout.ldc or n
    strides = layout.batch_strides or (m * k * 4, packed_b_size(k, n), m * n * 4)
    a_k_step, a_row_step = (lda * 4, 4) if trans_a else (4, lda * 4)
    body = _simd_body if "simd" in features else _scalar_body
    bias = None if at.bias is None else ("row" if layout.bias_per_row else "column")
    a_pack = "packed" if layout.a_packed else at.a_scratch
    inner, helpers = body(_Body(m, n, k, a_k_step, a_row_step, ldc * 4, bias, at.residual is not None, epilogue,
                                "relaxed-simd" in features, a_pack, tile_rows, spec.b_format, layout.b_block), name)
    def shifted(offset: int) -> str:
        return f"(i32.add (i32.const {offset}) (local.get $c_shift))" if layout.c_shift else f"(i32.const {offset})"

    pointers = [
        f"(local.set $A (i32.const {at.a}))",
        f"(local.set $B (i32.const {at.b_packed}))",
        f"(local.set $C {shifted(at.c)})",
        f"(local.set $R {shifted(at.residual or 0)})",
        f"(local.set $BIAS (i32.const {at.bias or 0}))",
    ]
    if spec.b_format == "int8":     # the column scales follow the panels
        pointers.append(f"(local.set $SCALE (i32.const {at.b_packed + -(-n // PANEL) * k * narrow_panel_bytes('int8')}))")
    code = pointers + _batch_loop(batch, strides, inner, bias_step=4 * m if layout.bias_per_row else 0)
    decls = ["(local $A i32) (local $B i32) (local $C i32) (local $R i32) (local $BIAS i32) (local $n i32)",
             "(local $i i32) (local $ib i32) (local $iend i32) (local $j i32) (local $j0 i32) (local $jend i32) (local $k0 i32) (local $klen i32) (local $first i32) (local $last i32)",
             "(local $pa i32) (local $pb i32) (local $pc i32) (local $pr i32) (local $pbias i32)",
             "(local $pend i32) (local $pend4 i32) (local $acc f32)"]
    if spec.b_format != "f32":
        decls += [WIDENING_LOCALS + (" (local $SCALE i32)" if spec.b_format == "int8" else "")
                  + (" " + BLOCK_WIDENING_LOCALS if spec.b_format in BLOCK_FORMATS else "")]
    if "simd" in features:  # v128 locals would make the module invalid on hosts without SIMD128
        decls += tile_locals() + scratch_locals("v128")
    decls += scratch_locals("f32")
    title = (f";; C[{m}x{n}] = {epilogue or 'identity'}(A{'^T' if trans_a else ''}[{m}x{k}] @ B[{k}x{n}]"
             f"{'' if spec.b_format == 'f32' else ' (' + spec.b_format + ')'}"
             f"{' + bias' if at.bias is not None else ''}{' + residual' if at.residual is not None else ''})"
             f"{f' x {batch} batches' if batch > 1 else ''}; features: {','.join(sorted(features)) or 'scalar'}")
    params = " (param $c_shift i32)" if layout.c_shift else ""
    return wat_function(name, title, decls, code, params) + helpers


@dataclass(frozen=True)
class _Body:
    """What the body renderers need: the product's shape, A's and C's steps in bytes, the bias
    ("row", "column" or None), the residual and the activation, FMA, how A is read (`a_pack`: the
    scratch offset its blocks are packed into, "packed" when A already is `pack_a(A)`, None to read
    it in place), the tile height and how B is stored."""
    m: int
    n: int
    k: int
    a_k_step: int
    a_row_step: int
    c_row_step: int
    bias: str | None
    has_residual: bool
    epilogue: str | None
    fma: bool
    a_pack: int | str | None
    rows_per_tile: int
    b_format: str = "f32"
    b_block: int = 0


def _batch_loop(batch: int, strides: tuple[int, int, int], inner: list[str], bias_step: int = 0) -> list[str]:
    if batch == 1:
        return inner
    sa, sb, sc = strides
    return [
        "(local.set $n (i32.const 0))",
        "(loop $batch",
        *("  " + s for s in inner),
        f"  (local.set $A (i32.add (local.get $A) (i32.const {sa})))",
        f"  (local.set $B (i32.add (local.get $B) (i32.const {sb})))",
        f"  (local.set $C (i32.add (local.get $C) (i32.const {sc})))",
        f"  (local.set $R (i32.add (local.get $R) (i32.const {sc})))",
        f"  (local.set $BIAS (i32.add (local.get $BIAS) (i32.const {bias_step})))",
        "  (local.set $n (i32.add (local.get $n) (i32.const 1)))",
        f"  (br_if $batch (i32.lt_u (local.get $n) (i32.const {batch}))))",
    ]



def gemm_scratch_bytes(m: int, k: int, tile_rows: int = TILE_ROWS, b_format: str = "f32") -> int:
    """What `a_scratch_offset` must hold: one packed block of A (row groups of the tile height), then
    for a narrow B one panel's K block widened to float32."""
    rows = -(-min(m, M_BLOCK) // tile_rows) * tile_rows
    a_block = rows * k_block_size(k) * 4
    return a_block + (_k_columns(m, k, tile_rows) * PANEL_BYTES if b_format != "f32" else 0)


def _k_columns(m: int, k: int, tile_rows: int) -> int:
    """K columns per block: all of K for one row tile, else `k_block_size`."""
    return k if m <= tile_rows else k_block_size(k)


def _simd_body(p: _Body, name: str) -> tuple[list[str], str]:
    """The function's body, and the functions it calls (the tiles' k loops, see `_k_function_unroll`)."""
    m, n, k, a_k_step, a_row_step, c_row_step, bias, has_residual, epilogue, fma, a_pack, rows_per_tile, b_format, b_block = astuple(p)
    kc = _k_columns(m, k, rows_per_tile)
    blocks = -(-k // kc)
    # Packed, a full tile's A values for one k are 16 contiguous bytes: one load for the 4 rows (see
    # kernels/microkernel.py). Measured (relaxed SIMD, wasmtime, CPU time): 256^3 36 -> 38 GFLOP/s,
    # 128^3 unchanged, 512^3 and up as fast as before only packed; A's rows aliasing in L1 (row
    # strides a multiple of 4 KiB) made 1024^3 run at 22 unpacked.
    packed = a_pack is not None and m > rows_per_tile
    # A packed: each group of rows_per_tile rows of the block as [kc][rows_per_tile], so a tile's k step reads
    # rows_per_tile adjacent floats instead of rows_per_tile rows lda apart (which alias in L1 when lda*4 is a
    # multiple of 4 KiB).
    tile_a_k_step, tile_a_row_step = (rows_per_tile * 4, 4) if packed else (a_k_step, a_row_step)
    geometry = TileGeometry(k, tile_a_k_step, tile_a_row_step, c_row_step, bias is not None, bias == "row",
                            has_residual, epilogue, fma,
                            static_first=True if blocks == 1 else None,
                            static_last=True if blocks == 1 else None,
                            unroll=_unroll(blocks, bias, has_residual, epilogue))
    function_unroll = _k_function_unroll(fma) if packed and rows_per_tile == MAX_ROWS else None
    k_function = f"{name}_k" if function_unroll else None
    edge_lanes = edge_pass_lanes(n % PANEL) if n % PANEL else []
    helpers = render_k_functions(k_function, geometry, function_unroll, edge_lanes) if k_function else ""
    # A narrow B: each panel's K block widened into the scratch after A's block before its row tiles.
    widened_at = a_pack + gemm_scratch_bytes(m, k, rows_per_tile) if b_format != "f32" else None

    def panel_block(step_bytes: int) -> str:
        """Where panel $j's K block $k0 starts in B, at `step_bytes` a k step."""
        return (f"(i32.add (local.get $B) (i32.mul (i32.add (i32.mul (local.get $j) (i32.const {k})) (local.get $k0))"
                f" (i32.const {step_bytes})))")

    if b_format in BLOCK_FORMATS:
        widen = render_block_quant_widening(BLOCK_FORMATS[b_format], b_block, k, n, "(local.get $B)", widened_at,
                                            "(local.get $k0)", "(local.get $klen)")
    else:
        widen = [] if widened_at is None else render_widened_block(
            b_format, panel_block(narrow_panel_bytes(b_format)), widened_at, "(local.get $klen)",
            f"(i32.add (local.get $SCALE) (i32.mul (local.get $j) (i32.const {PANEL_BYTES})))" if b_format == "int8" else None)

    def pack_a_block(rows: int) -> list[str]:
        """Rows $ib .. $ib + rows, columns $k0 .. $k0 + $klen of A into the scratch groups: groups of 4
        rows with v128 loads and stores, the rest one float at a time."""
        vector = rows_per_tile == 4 and 4 in (a_k_step, a_row_step)
        groups = rows // 4 if vector else 0
        code = counted_range("$i", 0, 4 * groups, 4, _pack_a_group4(a_pack, kc, a_k_step, a_row_step)) if groups else []
        if 4 * groups < rows:
            code += counted_range("$i", 4 * groups, rows, 1, [
                f"(local.set $pa (i32.add (local.get $A) (i32.add (i32.mul (i32.add (local.get $ib) (local.get $i)) (i32.const {a_row_step})) (i32.mul (local.get $k0) (i32.const {a_k_step})))))",
                f"(local.set $pb (i32.add (i32.const {a_pack}) (i32.add (i32.mul (i32.div_u (local.get $i) (i32.const {rows_per_tile})) (i32.const {kc * rows_per_tile * 4})) (i32.shl (i32.rem_u (local.get $i) (i32.const {rows_per_tile})) (i32.const 2)))))",
                f"(local.set $pend (i32.add (local.get $pb) (i32.mul (local.get $klen) (i32.const {rows_per_tile * 4}))))",
                "(loop $pack_k",
                "  (f32.store (local.get $pb) (f32.load (local.get $pa)))",
                f"  (local.set $pa (i32.add (local.get $pa) (i32.const {a_k_step})))",
                f"  (local.set $pb (i32.add (local.get $pb) (i32.const {rows_per_tile * 4})))",
                "  (br_if $pack_k (i32.lt_u (local.get $pb) (local.get $pend))))",
            ])
        return code

    def tile_at(rows: int, vecs: list[Vec]) -> list[str]:
        """Point $pa/$pb/$pc/$pr/$pbias at tile (i, j) of block k0, then run the tile."""
        if a_pack == "packed":  # pack_a's layout: block k0 at k0 * Mp floats, row i's group at i * klen
            padded_rows = -(-m // rows_per_tile) * rows_per_tile
            a_at = (f"(i32.add (i32.mul (local.get $k0) (i32.const {padded_rows * 4}))"
                    f" (i32.mul (local.get $i) (i32.shl (local.get $klen) (i32.const 2))))")
            a_base = "(local.get $A)"
        elif packed:  # tiles start rows_per_tile apart from $ib: group (i - ib) / rows_per_tile
            a_at = f"(i32.mul (i32.sub (local.get $i) (local.get $ib)) (i32.const {kc * 4}))"
            a_base = f"(i32.const {a_pack})"
        else:
            a_at = f"(i32.add (i32.mul (local.get $i) (i32.const {a_row_step})) (i32.mul (local.get $k0) (i32.const {a_k_step})))"
            a_base = "(local.get $A)"
        c_at = f"(i32.add (i32.mul (local.get $i) (i32.const {c_row_step})) (i32.mul (local.get $j) (i32.const {PANEL_BYTES})))"
        return [
            f"(local.set $pa (i32.add {a_base} {a_at}))",
            f"(local.set $pb {panel_block(PANEL_BYTES) if widened_at is None else f'(i32.const {widened_at})'})",
            f"(local.set $pc (i32.add (local.get $C) {c_at}))",
            f"(local.set $pr (i32.add (local.get $R) {c_at}))",
            ("(local.set $pbias (i32.add (local.get $BIAS) (i32.shl (local.get $i) (i32.const 2))))" if bias == "row" else
             f"(local.set $pbias (i32.add (local.get $BIAS) (i32.mul (local.get $j) (i32.const {PANEL_BYTES}))))"),
            f"(local.set $pend (i32.add (local.get $pb) (i32.mul (local.get $klen) (i32.const {PANEL_BYTES}))))",
            f"(local.set $pend4 (i32.add (local.get $pb) (i32.mul (i32.and (local.get $klen) (i32.const {-UNROLL})) (i32.const {PANEL_BYTES}))))",
            *render_tile(rows, vecs, geometry, k_function),
        ]

    def rows_loop(vecs: list[Vec], rows: int) -> list[str]:
        """Row tiles $ib .. $ib + rows: full tiles of rows_per_tile rows, then one shorter tile."""
        full, rest = divmod(rows, rows_per_tile)
        code = ["(local.set $i (local.get $ib))"]
        if full:
            code += [
                f"(local.set $iend (i32.add (local.get $ib) (i32.const {full * rows_per_tile})))",
                "(loop $loop_i",
                *("  " + s for s in tile_at(rows_per_tile, vecs)),
                f"  (local.set $i (i32.add (local.get $i) (i32.const {rows_per_tile})))",
                "  (br_if $loop_i (i32.lt_u (local.get $i) (local.get $iend))))",
            ]
        if rest:
            code += tile_at(rest, vecs)
        return code

    full_panels, edge = divmod(n, PANEL)
    chunk = _chunk_panels(m, n, blocks, packed and a_pack != "packed")

    def panels(rows: int, part: str) -> list[str]:
        """The panels of `part`: "all", the full panels of the chunk $j0 .. $jend ("chunk"), or the
        edge panel alone ("edge")."""
        one_panel = [Vec(0, v) for v in range(4)]
        code = []
        if part == "chunk":
            code += ["(local.set $j (local.get $j0))", "(loop $loop_j",
                     *("  " + s for s in widen + rows_loop(one_panel, rows)),
                     "  (local.set $j (i32.add (local.get $j) (i32.const 1)))",
                     "  (br_if $loop_j (i32.lt_u (local.get $j) (local.get $jend))))"]
        elif part == "all" and full_panels:
            code += counted_range("$j", 0, full_panels, 1, widen + rows_loop(one_panel, rows))
        if edge and part != "chunk":
            vecs = [Vec(0, v, min(4, edge - 4 * v)) for v in range(-(-edge // 4))]
            code += [f"(local.set $j (i32.const {full_panels}))", *widen, *rows_loop(vecs, rows)]
        return code

    # Row blocks of M_BLOCK keep the A block (M_BLOCK x 128 floats) in L2 while the panels sweep it.
    def block(rows: int, part: str) -> list[str]:
        return (pack_a_block(rows) if packed and a_pack != "packed" else []) + panels(rows, part)

    def k_blocks(part: str) -> list[str]:
        full_blocks, last_rows = divmod(m, M_BLOCK)
        code = counted_range("$ib", 0, full_blocks * M_BLOCK, M_BLOCK, block(M_BLOCK, part)) if full_blocks else []
        if last_rows:
            code += [f"(local.set $ib (i32.const {full_blocks * M_BLOCK}))", *block(last_rows, part)]
        k_block = [
            "(local.set $first (i32.eqz (local.get $k0)))",
            f"(local.set $last (i32.ge_u (i32.add (local.get $k0) (i32.const {kc})) (i32.const {k})))",
            f"(local.set $klen (select (i32.sub (i32.const {k}) (local.get $k0)) (i32.const {kc}) (local.get $last)))",
            *code,
        ]
        return counted_range("$k0", 0, k, kc, k_block)

    if chunk is None:
        return k_blocks("all"), helpers
    # Column chunks (outermost): every K block passes over one chunk of C while it stays in cache.
    code = counted_range("$j0", 0, full_panels, chunk, [
        f"(local.set $jend (i32.add (local.get $j0) (i32.const {chunk})))",
        f"(local.set $jend (select (local.get $jend) (i32.const {full_panels})"
        f" (i32.lt_u (local.get $jend) (i32.const {full_panels}))))",
        *k_blocks("chunk")])
    return code + (k_blocks("edge") if edge else []), helpers


# Bytes of C one column chunk covers (see `_chunk_panels`).
C_CHUNK_BYTES = 256 << 10


def _chunk_panels(m: int, n: int, blocks: int, packs_at_run_time: bool) -> int | None:
    """Panels per column chunk, or None to sweep all of C on every K block. Each K block is a pass
    over C: where C is larger than L2 (a Conv's NCHW output, M channels x N pixels) every tile's
    first loads of C wait for L3 or memory, so the columns go in chunks of about C_CHUNK_BYTES,
    each finished over every K block before the next; A is then read once per chunk (and packed
    once per chunk when the kernel packs it: then chunks of at least 16 panels amortise that).
    Measured (Conv + bias + relu, im2col with A packed at compile time, wasmtime 50, relaxed SIMD,
    CPU time, min of 7 interleaved rounds, GFLOP/s, whole C / 256 KiB chunks): vgg19's 3x3
    64->128 at 112x112 34.9 -> 41.5, 256->256 at 56x56 40.8 -> 41.6, 512->512 at 28x28 39.8 -> 45.6."""
    full_panels = n // PANEL
    if blocks == 1 or m * n * 4 <= 4 * C_CHUNK_BYTES:
        return None
    chunk = max(16 if packs_at_run_time else 1, C_CHUNK_BYTES // (m * PANEL_BYTES))
    return chunk if chunk < full_panels else None


def _pack_a_group4(a_pack: int, kc: int, a_k_step: int, a_row_step: int) -> list[str]:
    """Rows $ib + $i .. + 3 of the K block into their group [klen][4] of the scratch, v128 at a time.
    Rows along k (A as given): 4 k at a time, a 4x4 transpose by shuffles, then the last klen % 4 k
    one float per row. Rows adjacent (A^T): the 4 rows at one k are already one v128."""
    code = [
        f"(local.set $pa (i32.add (local.get $A) (i32.add (i32.mul (i32.add (local.get $ib) (local.get $i)) (i32.const {a_row_step})) (i32.mul (local.get $k0) (i32.const {a_k_step})))))",
        f"(local.set $pb (i32.add (i32.const {a_pack}) (i32.mul (local.get $i) (i32.const {kc * 4}))))",
    ]
    if a_row_step == 4:
        return code + [
            "(local.set $pend (i32.add (local.get $pb) (i32.shl (local.get $klen) (i32.const 4))))",
            "(loop $pack_k",
            "  (v128.store (local.get $pb) (v128.load (local.get $pa)))",
            f"  (local.set $pa (i32.add (local.get $pa) (i32.const {a_k_step})))",
            "  (local.set $pb (i32.add (local.get $pb) (i32.const 16)))",
            "  (br_if $pack_k (i32.lt_u (local.get $pb) (local.get $pend))))",
        ]
    row = [f"(local.get $a{r})" for r in range(4)]
    low = [f"(i8x16.shuffle {shuffle_lanes(0, 4, 1, 5)} {row[0]} {row[1]})", f"(i8x16.shuffle {shuffle_lanes(0, 4, 1, 5)} {row[2]} {row[3]})"]
    high = [f"(i8x16.shuffle {shuffle_lanes(2, 6, 3, 7)} {row[0]} {row[1]})", f"(i8x16.shuffle {shuffle_lanes(2, 6, 3, 7)} {row[2]} {row[3]})"]
    columns = [f"(i8x16.shuffle {shuffle_lanes(*lanes)} {pair[0]} {pair[1]})"
               for pair in (low, high) for lanes in ((0, 1, 4, 5), (2, 3, 6, 7))]  # k, k+1, k+2, k+3
    return code + [
        "(local.set $pend (i32.add (local.get $pb) (i32.shl (i32.and (local.get $klen) (i32.const -4)) (i32.const 4))))",
        "(if (i32.lt_u (local.get $pb) (local.get $pend)) (then (loop $pack_k4",
        *(f"  (local.set $a{r} (v128.load offset={r * a_row_step} (local.get $pa)))" for r in range(4)),
        *(f"  (v128.store offset={16 * c} (local.get $pb) {column})" for c, column in enumerate(columns)),
        "  (local.set $pa (i32.add (local.get $pa) (i32.const 16)))",
        "  (local.set $pb (i32.add (local.get $pb) (i32.const 64)))",
        "  (br_if $pack_k4 (i32.lt_u (local.get $pb) (local.get $pend))))))",
        f"(local.set $pend (i32.add (i32.const {a_pack}) (i32.add (i32.mul (local.get $i) (i32.const {kc * 4})) (i32.shl (local.get $klen) (i32.const 4)))))",
        "(block $pack_done (loop $pack_k",
        "  (br_if $pack_done (i32.ge_u (local.get $pb) (local.get $pend)))",
        *(f"  (f32.store offset={4 * r} (local.get $pb) (f32.load offset={r * a_row_step} (local.get $pa)))" for r in range(4)),
        "  (local.set $pa (i32.add (local.get $pa) (i32.const 4)))",
        "  (local.set $pb (i32.add (local.get $pb) (i32.const 16)))",
        "  (br $pack_k)))",
    ]


def _unroll(blocks: int, bias, has_residual: bool, epilogue) -> int:
    """k steps per iteration of the tile's inline loop: with mul + add, and with relaxed SIMD for the
    passes `_k_function_unroll`'s function does not serve (edge vectors, short and one-row tiles, A
    read in place). The measurements below are of the inline loop with relaxed SIMD, from before
    that function. More steps share the back-edge's register moves (8
    per iteration), but whether Cranelift's register allocator then keeps all 8 accumulators in
    registers depends on the code around the loop, and a spill that lands in an accumulator's
    dependency chain costs about a third of the speed. Measured (relaxed SIMD, A packed, wasmtime
    50, GFLOP/s at the median of 9, FMA peak 57-58 in the same runs; unroll 1 / 8):
    - plain products over several K blocks: 512^3 38.5 / 41.8, 1024^3 39.2 / 42.2, 256^3 36.1 / 38.8,
      128x384x384 37.8 / 41.4, 128x1536x384 36.2 / 40.7, 128x384x1536 36.8 / 40.6,
      64x3136x576 35.7 / 38.2, 256x784x1152 39.2 / 42.7;
    - one K block (512x512x128: 37.5 / 32.8, 128^3: 32.5 / 30.3), or with a relu or gelu epilogue
      (512^3: 38.2 / 26.1 and 36.9 / 25.4), a bias (128x384x384: 37.0 / 24.5) or a residual
      (512^3: 39.4 / 26.0): unroll 1 is the faster.
    Unroll 2 with a bias or a residual (unroll 1 / 2): faster on 512^3 (39.3 / 43.6), 512x512x128,
    64x3136x576, 128x384x1536, slower on 256x784x1152 (39.2 / 33.5) and 256^3 (39.1 / 32.6), and with
    a residual on 512x512x128 (37.9 / 26.8). With the activation moved to a pass over C after the
    product (its constants then no longer hoisted around the tiles) and unroll 8: bias + gelu faster
    on all 6 of those shapes (512^3 37.9 -> 41.5), bias + relu slower on 256x784x1152 and 256^3
    (38.7 -> 25.3, 36.7 -> 25.5). Neither is taken: unroll 1 is never the slow one.
    """
    plain = bias is None and not has_residual and epilogue is None
    return 8 if plain and blocks > 1 else 1


def _k_function_unroll(fma: bool) -> int | None:
    """Unroll of the tiles' k loop as a function of its own (kernels/microkernel.py,
    `render_k_functions`), or None to keep the loop inline (then `_unroll` decides).

    With relaxed SIMD the function, unrolled 8 times, is faster than the inline loop for every shape
    and epilogue measured, plain products included: its loop has no spill and no register move
    (objdump of the serialized module), where the inline one unrolled spills with an epilogue and
    runs unroll 1. Measured (wasmtime 50, relaxed SIMD, A packed, CPU time, median of 5 interleaved
    rounds of both kernels, this rule overridden, GFLOP/s, inline -> function; `python -m
    bench.gemm_bench --epilogues` times the kernel chosen here on the same cases):
      shape          bias         bias+relu    bias+gelu    residual     plain
      512^3          39.2 -> 47.3 39.2 -> 46.6 37.6 -> 44.5 37.9 -> 46.1 42.6 -> 47.3
      256^3          40.5 -> 49.2 40.1 -> 46.9 37.1 -> 43.5 39.8 -> 47.7 46.1 -> 48.2
      128x384x384    39.1 -> 48.0 40.5 -> 48.4 37.4 -> 44.3 40.2 -> 49.5 44.8 -> 49.6
      128x1536x384   38.9 -> 47.6 40.1 -> 47.5 38.3 -> 45.0 40.0 -> 47.4 44.2 -> 49.2
      128x384x1536   40.6 -> 49.6 40.7 -> 49.6 36.6 -> 44.6 38.6 -> 46.9 44.4 -> 47.2
      64x3136x576 *  37.1 -> 44.9 35.5 -> 42.5 34.2 -> 40.3 35.6 -> 42.6 38.6 -> 40.8
      256x784x1152 * 38.0 -> 45.9 37.9 -> 46.0 37.8 -> 45.1 38.2 -> 46.6 42.2 -> 46.6
    (* per-row bias, as Conv's). One K block (bias+relu / plain): 512x512x128 38.5 -> 45.2 /
    39.6 -> 48.4, 128^3 38.5 -> 46.0 / 39.2 -> 48.9, 64^3 37.4 -> 42.6 / 38.3 -> 48.2.
    The function unrolled 2 or 4 times spills an accumulator in its loop (Cranelift's choice, not
    register pressure: 8 accumulators, 4 splats, 2 B vectors) and runs at 26-28 and 32-36.
    Edge panels (N not a multiple of 16) call functions rendered for their passes' widths (one
    vector: even and odd k steps into two sets of accumulators), instead of the inline loop at
    unroll 1 (bias+relu / bias+gelu, inline edge -> function edge): 512x49x4608 35.4 -> 37.3 /
    35.9 -> 36.7, 2048x49x512 38.4 -> 40.7 / 37.3 -> 38.5, 256x52x1152 42.1 -> 44.2 / 36.7 -> 40.7,
    128x20x384 38.0 -> 42.1 / 36.6 -> 38.4, 64x3137x576 39.5 -> 41.2 / 38.3 -> 38.9.
    Whole models through the compiler (relaxed SIMD, sum over CUs of each CU's min_ms over 3
    interleaved runs of `cortex bench DAG --repeat 5 --json`, before -> with the function -> with
    the edge functions too): MiniLM-L6 at 128 tokens 82.2 -> 69.1 ms (its products have no edge),
    light_resnet50 239.6 -> 215.3 -> 212.4 ms.
    With mul + add (SIMD without relaxed) the inline loop stays: 512^3 bias 36.9 vs 35.9, plain
    35.8 vs 33.7, 128x1536x384 bias+gelu 31.3 vs 30.6, 256x784x1152 bias 35.5 vs 34.1.
    """
    return 8 if fma else None


def _scalar_body(p: _Body, name: str) -> tuple[list[str], str]:
    """Plain f32 loops over the same packed B, for hosts without SIMD128."""
    m, n, k, a_k_step, a_row_step, c_row_step, bias, has_residual, epilogue = astuple(p)[:9]
    index = "$i" if bias == "row" else "$j"
    init = f"(f32.load (i32.add (local.get $BIAS) (i32.shl (local.get {index}) (i32.const 2))))" if bias else "(f32.const 0)"
    c_at = f"(i32.add (i32.mul (local.get $i) (i32.const {c_row_step})) (i32.shl (local.get $j) (i32.const 2)))"
    if has_residual:
        init = f"(f32.add {init} (f32.load (i32.add (local.get $R) {c_at})))"
    col = [
        f"(local.set $acc {init})",
        f"(local.set $pa (i32.add (local.get $A) (i32.mul (local.get $i) (i32.const {a_row_step}))))",
        # packed B: panel j/16, row k, lane j%16
        f"(local.set $pb (i32.add (local.get $B) (i32.shl (i32.add (i32.mul (i32.shr_u (local.get $j) (i32.const 4)) (i32.const {k * PANEL})) (i32.and (local.get $j) (i32.const 15))) (i32.const 2))))",
        f"(local.set $pend (i32.add (local.get $pb) (i32.const {k * PANEL_BYTES})))",
        "(loop $k",
        "  (local.set $acc (f32.add (local.get $acc) (f32.mul (f32.load (local.get $pa)) (f32.load (local.get $pb)))))",
        f"  (local.set $pa (i32.add (local.get $pa) (i32.const {a_k_step})))",
        f"  (local.set $pb (i32.add (local.get $pb) (i32.const {PANEL_BYTES})))",
        "  (br_if $k (i32.lt_u (local.get $pb) (local.get $pend))))",
        *f32_activation(epilogue, "$acc"),
        f"(f32.store (i32.add (local.get $C) {c_at}) (local.get $acc))",
    ]
    return counted_range("$i", 0, m, 1, counted_range("$j", 0, n, 1, col)), ""
