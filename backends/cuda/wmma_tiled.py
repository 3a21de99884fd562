"""The block-tiled tensor-core GEMM (and implicit-GEMM Conv): several warps per block, each warp a grid
of 16x16 accumulator fragments, the block's A and B tiles staged through a multi-stage cuda_pipeline
ring in shared memory.

Why this shape: a warp that owns one 16x16 tile loads a fragment of A and one of B for each mma, so
the tensor cores wait on shared memory; a warp owning FM x FN fragments reuses each A fragment FN times
and each B fragment FM times. A block of several warps shares one staged tile of A and B, so each
global element is read once per block instead of once per warp. The ring keeps `stages - 1` tiles in
flight while the warps multiply the current one (`__pipeline_wait_prior(stages - 2)`), hiding the
global-memory latency. Rows of the staged tiles are padded (4 floats, 8 halves) so the fragment
loads of successive rows fall into different banks; each pad keeps WMMA's 16-byte `ldm` multiple and
every fragment's 32-byte alignment.

Bounds: loads past M, N or K are zero-filled (a zero adds nothing to the sums), and the epilogue goes
through a shared-memory copy of the accumulators, so each thread stores only the cells inside the
output and runs the fused epilogue (`fuse`) at them. The accumulators start from y's value, staged the
same way. The tile is chosen by problem size (`choose_tiling`): a large tile only where it still
leaves at least one block per SM of an H200.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.cuda.fuse import Unit
from backends.cuda.tiled import TILE, TiledContraction
from backends.cuda.wmma_common import ELEMENT, KSTEP, ROUND, stage_element

SMS = 132                      # streaming multiprocessors of an H200 (SXM)
STATIC_SHARED = 48 * 1024      # the most static shared memory a block may declare
BK = 16                        # K per pipeline stage: one fp16/bf16 step, two tf32 steps
PAD = {"float": 4, "half": 8}  # row padding, in elements: 16 bytes either way


@dataclass(frozen=True)
class WarpTiling:
    name: str
    warp_rows: int        # warps along M
    warp_cols: int        # warps along N
    frag_rows: int        # 16x16 fragments per warp along M
    frag_cols: int        # along N
    stages: int           # the most pipeline stages; fewer where shared memory is short

    @property
    def warps(self) -> int:
        return self.warp_rows * self.warp_cols

    @property
    def block_m(self) -> int:
        return self.warp_rows * self.frag_rows * TILE

    @property
    def block_n(self) -> int:
        return self.warp_cols * self.frag_cols * TILE


# Largest first: 8 warps of 32x32 (2x2 fragments), 4 warps of 32x32, and 4 warps of one fragment
# each for problems too small to fill the SMs otherwise.
TILINGS = (WarpTiling("128x64", 4, 2, 2, 2, 3), WarpTiling("64x64", 2, 2, 2, 2, 3),
           WarpTiling("32x32", 2, 2, 1, 1, 2))
BY_NAME = {t.name: t for t in TILINGS}


@dataclass(frozen=True)
class SharedLayout:
    """Where a tiling's stages, accumulators and rounded copies sit, in floats of one array."""
    lda: int              # row stride of a staged A tile (BK + pad)
    ldb: int              # of a staged B tile (block_n + pad)
    ldc: int              # of the accumulators' staging
    a_slot: int           # floats of one stage's A tile
    slot: int             # floats of one stage (A then B)
    floats: int           # the float array: the stages, reused by the accumulators before and after
    lda_round: int        # strides of the rounded (fp16/bf16) copy of the current stage
    ldb_round: int
    stages: int

    def bytes(self, precision: str) -> int:
        rounded = 0 if precision == "tf32" else 2 * (self.a_slot // self.lda * self.lda_round + BK * self.ldb_round)
        return 4 * self.floats + rounded


def shared_layout(t: WarpTiling, precision: str) -> SharedLayout:
    """The most stages (down to 2) whose shared memory fits the static limit."""
    lda, ldb, ldc = BK + PAD["float"], t.block_n + PAD["float"], t.block_n + PAD["float"]
    a_slot = t.block_m * lda
    slot = a_slot + BK * ldb
    for stages in range(t.stages, 1, -1):
        layout = SharedLayout(lda, ldb, ldc, a_slot, slot, max(stages * slot, t.block_m * ldc),
                              BK + PAD["half"], t.block_n + PAD["half"], stages)
        if layout.bytes(precision) <= STATIC_SHARED:
            return layout
    raise ValueError(f"tiling {t.name} does not fit {STATIC_SHARED} bytes of shared memory")


def choose_tiling(plan: TiledContraction, tile: str = "auto") -> WarpTiling:
    """`tile` names one of TILINGS, or `auto`: the largest whose blocks still cover every SM once."""
    m, n, b = (plan.extent(x) for x in (plan.rows, plan.cols, plan.batch))
    return tiling_for(m, n, b, tile)


def tiling_for(m: int, n: int, b: int, tile: str = "auto") -> WarpTiling:
    """The tiling of an m x n output (b of them): the named one, or as `choose_tiling` picks."""
    if tile != "auto":
        return BY_NAME[tile]
    for t in TILINGS:
        if -(-m // t.block_m) * -(-n // t.block_n) * b >= SMS:
            return t
    return TILINGS[-1]


def tiled_launch_geometry(plan: TiledContraction, t: WarpTiling) -> tuple[list[int], list[int]]:
    m, n, b = (plan.extent(x) for x in (plan.rows, plan.cols, plan.batch))
    return [-(-n // t.block_n), -(-m // t.block_m), b], [32, t.warps, 1]


def _fill_stage(r, plan: TiledContraction, t: WarpTiling, s: SharedLayout, kt: str, slot: str, indent: str) -> list[str]:
    """Stage A and B of K tile `kt` into ring slot `slot`: async copies where they can, zeros outside."""
    m, n, k = plan.extent(plan.rows), plan.extent(plan.cols), plan.extent(plan.k)
    threads, i = 32 * t.warps, indent
    return [f"{i}{{",
            f"{i}  float* const a_fill = smem + ({slot}) * {s.slot};",
            f"{i}  float* const b_fill = a_fill + {s.a_slot};",
            f"{i}  for (int e = tid; e < {t.block_m * BK}; e += {threads}) {{",
            f"{i}    const int row = row0 + e / {BK}, k_at = ({kt}) * {BK} + e % {BK};",
            *r.decompose("row", plan.rows, i + "    "), *r.decompose("k_at", plan.k, i + "    "),
            *stage_element(r, plan.a, f"a_fill[(e / {BK}) * {s.lda} + e % {BK}]", f"row < {m} && k_at < {k}", i + "    "),
            f"{i}  }}",
            f"{i}  for (int e = tid; e < {BK * t.block_n}; e += {threads}) {{",
            f"{i}    const int k_at = ({kt}) * {BK} + e / {t.block_n}, col = col0 + e % {t.block_n};",
            *r.decompose("col", plan.cols, i + "    "), *r.decompose("k_at", plan.k, i + "    "),
            *stage_element(r, plan.b, f"b_fill[(e / {t.block_n}) * {s.ldb} + e % {t.block_n}]",
                           f"col < {n} && k_at < {k}", i + "    "),
            f"{i}  }}",
            f"{i}}}"]


def render_tiled_wmma(r, unit: Unit, plan: TiledContraction, precision: str, t: WarpTiling) -> str:
    r._names = {}
    ks, element, s = KSTEP[precision], ELEMENT[precision], shared_layout(t, precision)
    m, n, k = plan.extent(plan.rows), plan.extent(plan.cols), plan.extent(plan.k)
    bm, bn, threads, stages = t.block_m, t.block_n, 32 * t.warps, s.stages
    y = r.buffer_name(plan.store.buffer.storage)
    lines = r.header(unit.name, unit.kernel, [plan.store, *(s_ for p in unit.fused for s_ in p.stmts)], threads)
    lines[1] = (f"  // tensor cores ({precision}, {t.name} block of {t.warps} warps, "
                f"{t.frag_rows}x{t.frag_cols} fragments per warp, {stages} stages): " +
                ", ".join(f"{p.kernel.op_type} ({p.kernel.name})" for p in unit.parts))
    lines += [f"  __shared__ __align__(32) float smem[{s.floats}];"]
    if precision != "tf32":
        lines += [f"  __shared__ __align__(32) {element} a_round[{bm * s.lda_round}];",
                  f"  __shared__ __align__(32) {element} b_round[{BK * s.ldb_round}];"]
    lines += ["  const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;",
              f"  const int row0 = blockIdx.y * {bm}, col0 = blockIdx.x * {bn};",
              (f"  const int warp_row = (warp / {t.warp_cols}) * {t.frag_rows * TILE}, "
               f"warp_col = (warp % {t.warp_cols}) * {t.frag_cols * TILE};"),
              "  float* const c_tile = smem;   // the accumulators' staging: the stages' memory, before and after them"]
    lines += r.decompose("blockIdx.z", plan.batch, "  ")
    index = None

    def cell(indent: str) -> list[str]:
        nonlocal index
        out = [f"{indent}const int row = row0 + e / {bn}, col = col0 + e % {bn};",
               *r.decompose("row", plan.rows, indent), *r.decompose("col", plan.cols, indent)]
        index = r.expr(plan.store.index)
        return out

    frag = f"{TILE}, {TILE}, {ks}"
    at_c = f"c_tile + (warp_row + i * {TILE}) * {s.ldc} + warp_col + j * {TILE}"
    each = f"for (int i = 0; i < {t.frag_rows}; ++i) for (int j = 0; j < {t.frag_cols}; ++j)"
    k_tiles = -(-k // BK)
    lines += [f"  for (int e = tid; e < {bm * bn}; e += {threads}) {{", *cell("    "),
              f"    c_tile[(e / {bn}) * {s.ldc} + e % {bn}] = (row < {m} && col < {n}) ? {y}[{index}] : 0.0f;", "  }",
              "  __syncthreads();",
              f"  wmma::fragment<wmma::accumulator, {frag}, float> acc_frag[{t.frag_rows}][{t.frag_cols}];",
              f"  {each} wmma::load_matrix_sync(acc_frag[i][j], {at_c}, {s.ldc}, wmma::mem_row_major);",
              "  __syncthreads();   // the stages below overwrite c_tile",
              f"  for (int s = 0; s < {stages - 1}; ++s) {{   // the ring's first stages in flight",
              f"    if (s < {k_tiles})", *_fill_stage(r, plan, t, s, "s", "s", "    "),
              "    __pipeline_commit();   // one batch per stage, empty or not, so wait_prior counts stages",
              "  }",
              f"  for (int kt = 0; kt < {k_tiles}; ++kt) {{",
              f"    __pipeline_wait_prior({stages - 2});   // this thread's copies of stage kt are done",
              "    __syncthreads();   // everyone's are, and every warp is done with the slot refilled below",
              f"    if (kt + {stages - 1} < {k_tiles})",
              *_fill_stage(r, plan, t, s, f"kt + {stages - 1}", f"(kt + {stages - 1}) % {stages}", "    "),
              "    __pipeline_commit();",
              f"    const float* const a_slot = smem + (kt % {stages}) * {s.slot};",
              f"    const float* const b_slot = a_slot + {s.a_slot};"]
    if precision == "tf32":
        a_src, b_src, lda, ldb = "a_slot", "b_slot", s.lda, s.ldb
    else:
        rnd, a_src, b_src, lda, ldb = ROUND[precision], "a_round", "b_round", s.lda_round, s.ldb_round
        lines += [(f"    for (int e = tid; e < {bm * BK}; e += {threads}) "
                   f"a_round[(e / {BK}) * {lda} + e % {BK}] = {rnd}(a_slot[(e / {BK}) * {s.lda} + e % {BK}]);"),
                  (f"    for (int e = tid; e < {BK * bn}; e += {threads}) "
                   f"b_round[(e / {bn}) * {ldb} + e % {bn}] = {rnd}(b_slot[(e / {bn}) * {s.ldb} + e % {bn}]);"),
                  "    __syncthreads();"]
    lines += [f"    for (int kk = 0; kk < {BK}; kk += {ks}) {{",
              f"      wmma::fragment<wmma::matrix_a, {frag}, {element}, wmma::row_major> a_frag[{t.frag_rows}];",
              f"      wmma::fragment<wmma::matrix_b, {frag}, {element}, wmma::row_major> b_frag[{t.frag_cols}];",
              (f"      for (int i = 0; i < {t.frag_rows}; ++i) "
               f"wmma::load_matrix_sync(a_frag[i], {a_src} + (warp_row + i * {TILE}) * {lda} + kk, {lda});"),
              (f"      for (int j = 0; j < {t.frag_cols}; ++j) "
               f"wmma::load_matrix_sync(b_frag[j], {b_src} + kk * {ldb} + warp_col + j * {TILE}, {ldb});")]
    if precision == "tf32":
        lines += [(f"      for (int i = 0; i < {t.frag_rows}; ++i) for (int x = 0; x < a_frag[i].num_elements; ++x) "
                   "a_frag[i].x[x] = wmma::__float_to_tf32(a_frag[i].x[x]);"),
                  (f"      for (int j = 0; j < {t.frag_cols}; ++j) for (int x = 0; x < b_frag[j].num_elements; ++x) "
                   "b_frag[j].x[x] = wmma::__float_to_tf32(b_frag[j].x[x]);")]
    lines += [f"      {each} wmma::mma_sync(acc_frag[i][j], a_frag[i], b_frag[j], acc_frag[i][j]);",
              "    }",
              "  }",
              "  __syncthreads();   // every warp is done with the stages: c_tile reuses them",
              f"  {each} wmma::store_matrix_sync({at_c}, acc_frag[i][j], {s.ldc}, wmma::mem_row_major);",
              "  __syncthreads();",
              f"  for (int e = tid; e < {bm * bn}; e += {threads}) {{", *cell("    "),
              f"    if (row >= {m} || col >= {n}) continue;",
              f"    const float acc = c_tile[(e / {bn}) * {s.ldc} + e % {bn}];",
              f"    {y}[{index}] = acc;"]
    lines += ["  " + line for line in r.epilogue(unit, plan.store)]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"
