"""Tensor-core contractions: a tiled GEMM (or implicit-GEMM Conv, see `tiled`) on the WMMA API.

Opt-in, because the inputs are rounded before they are multiplied (`--precision`): tf32 keeps 10
mantissa bits of a float32, fp16 10 bits with a narrower range, bf16 7 bits with float32's range.
Products are exact in float32 and the sums accumulate in float32, so only the rounding of the inputs
changes the numbers.

Two kernels. The default (`--tensor-core-tile auto`) is wmma_tiled's: blocks of several warps, each
warp a grid of fragments, a multi-stage pipeline. `single` keeps the first kernel, to compare against:
each warp owns one 16x16 output tile; a block holds `WARPS` warps stacked along the rows. Per step of
K, the lanes stage a 16 x KSTEP slice of `a` and a KSTEP x 16 slice of `b` in shared memory: an operand
that is a plain float32 load goes through `__pipeline_memcpy_async` (commit, then wait for it), one
computed on the fly (a padded Conv's taps) is stored directly. The slices are rounded to the input
precision, loaded into fragments and multiplied into an accumulator fragment that starts from y's
value. At the end the accumulator goes back through shared memory, so each lane stores its cells and
runs the fused epilogue (`fuse`) at them, as the scalar tiled kernel does.

Only the WMMA C++ API is used (no inline PTX), so cuda-sim emulates the same source exactly: its
shim makes the fragment operations warp collectives and defers each async copy to the wait that needs it.
"""

from __future__ import annotations

from backends.cuda.fuse import Unit
from backends.cuda.tiled import TILE, TiledContraction
from backends.cuda.wmma_common import ELEMENT, KSTEP, ROUND, stage_element
from backends.cuda.wmma_tiled import (
    TILINGS,
    choose_tiling,
    render_tiled_wmma,
    tiled_launch_geometry,
)

PRECISIONS = ("exact", "tf32", "fp16", "bf16")
WARPS = 4                    # warps (16-row tiles) per block
TILES = ("auto", "single", *(t.name for t in TILINGS))
# Smaller products leave the tensor cores idle and pay for the staging; they keep the exact kernel.
MIN_WORK = 16 * 16 * 16

HEADERS = """\
#ifndef CUDA_SIM
#include <mma.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#endif
using namespace nvcuda;
"""


def choose_precision(plan: TiledContraction | None, precision: str) -> str:
    """The precision one contraction runs at: tensor cores where asked for and the product is a
    float32 GEMM large enough to fill a 16x16 tile with K of at least one step."""
    if plan is None or precision == "exact":
        return "exact"
    m, n, k = (plan.extent(x) for x in (plan.rows, plan.cols, plan.k))
    if plan.store.buffer.storage.dtype != "float32" or m < TILE or n < TILE or k < KSTEP[precision] \
            or m * n * k < MIN_WORK:
        return "exact"
    return precision


def launch_geometry(plan: TiledContraction, tile: str = "auto") -> tuple[list[int], list[int]]:
    if tile != "single":
        return tiled_launch_geometry(plan, choose_tiling(plan, tile))
    m, n, b = (plan.extent(x) for x in (plan.rows, plan.cols, plan.batch))
    return [-(-n // TILE), -(-m // (TILE * WARPS)), b], [32, WARPS, 1]


def render_wmma_function(r, unit: Unit, plan: TiledContraction, precision: str, tile: str = "auto") -> str:
    """`tile`: `single` for one 16x16 tile per warp (the first kernel, kept to compare against),
    else a block tiling of wmma_tiled (`auto`: chosen by the problem's size)."""
    if tile != "single":
        return render_tiled_wmma(r, unit, plan, precision, choose_tiling(plan, tile))
    return render_single_tile(r, unit, plan, precision)


def render_single_tile(r, unit: Unit, plan: TiledContraction, precision: str) -> str:
    r._names = {}
    ks, element = KSTEP[precision], ELEMENT[precision]
    m, n, k = plan.extent(plan.rows), plan.extent(plan.cols), plan.extent(plan.k)
    y = r.buffer_name(plan.store.buffer.storage)
    lines = r.header(unit.name, unit.kernel, [plan.store, *(s for p in unit.fused for s in p.stmts)], 32 * WARPS)
    lines[1] = (f"  // tensor cores ({precision}): " +
                ", ".join(f"{p.kernel.op_type} ({p.kernel.name})" for p in unit.parts))
    staged = "float" if precision == "tf32" else element
    lines += [f"  __shared__ __align__(32) float a_stage[{WARPS}][{TILE * ks}];",
              f"  __shared__ __align__(32) float b_stage[{WARPS}][{ks * TILE}];",
              f"  __shared__ __align__(32) float c_stage[{WARPS}][{TILE * TILE}];"]
    if precision != "tf32":
        lines += [f"  __shared__ __align__(32) {staged} a_round[{WARPS}][{TILE * ks}];",
                  f"  __shared__ __align__(32) {staged} b_round[{WARPS}][{ks * TILE}];"]
    lines += ["  const int lane = threadIdx.x, warp = threadIdx.y;",
              f"  const int row0 = (blockIdx.y * {WARPS} + warp) * {TILE}, col0 = blockIdx.x * {TILE};",
              f"  if (row0 >= {m}) return;   // a whole warp past the last row: no block barrier below",
              "  float* const c_tile = c_stage[warp];"]
    lines += r.decompose("blockIdx.z", plan.batch, "  ")
    index = None

    def cell(e: str, indent: str) -> list[str]:
        nonlocal index
        out = [f"{indent}const int row = row0 + {e} / {TILE}, col = col0 + {e} % {TILE};",
               *r.decompose("row", plan.rows, indent), *r.decompose("col", plan.cols, indent)]
        index = r.expr(plan.store.index)
        return out

    lines += [f"  for (int e = lane; e < {TILE * TILE}; e += 32) {{", *cell("e", "    "),
              f"    c_tile[e] = (row < {m} && col < {n}) ? {y}[{index}] : 0.0f;", "  }",
              "  __syncwarp();",
              f"  wmma::fragment<wmma::accumulator, 16, 16, {ks}, float> acc_frag;",
              "  wmma::load_matrix_sync(acc_frag, c_tile, 16, wmma::mem_row_major);",
              f"  for (int k0 = 0; k0 < {k}; k0 += {ks}) {{",
              f"    for (int e = lane; e < {TILE * ks}; e += 32) {{",
              f"      const int row = row0 + e / {ks}, k_at = k0 + e % {ks};",
              *r.decompose("row", plan.rows, "      "), *r.decompose("k_at", plan.k, "      "),
              *stage_element(r, plan.a, "a_stage[warp][e]", f"row < {m} && k_at < {k}", "      "), "    }",
              f"    for (int e = lane; e < {ks * TILE}; e += 32) {{",
              f"      const int k_at = k0 + e / {TILE}, col = col0 + e % {TILE};",
              *r.decompose("col", plan.cols, "      "), *r.decompose("k_at", plan.k, "      "),
              *stage_element(r, plan.b, "b_stage[warp][e]", f"col < {n} && k_at < {k}", "      "), "    }",
              "    __pipeline_commit();",
              "    __pipeline_wait_prior(0);",
              "    __syncwarp();",
              f"    wmma::fragment<wmma::matrix_a, 16, 16, {ks}, {element}, wmma::row_major> a_frag;",
              f"    wmma::fragment<wmma::matrix_b, 16, 16, {ks}, {element}, wmma::row_major> b_frag;"]
    if precision == "tf32":
        lines += [f"    wmma::load_matrix_sync(a_frag, a_stage[warp], {ks});",
                  f"    wmma::load_matrix_sync(b_frag, b_stage[warp], {TILE});",
                  "    for (int t = 0; t < a_frag.num_elements; ++t) a_frag.x[t] = wmma::__float_to_tf32(a_frag.x[t]);",
                  "    for (int t = 0; t < b_frag.num_elements; ++t) b_frag.x[t] = wmma::__float_to_tf32(b_frag.x[t]);"]
    else:
        rnd = ROUND[precision]
        lines += [f"    for (int e = lane; e < {TILE * ks}; e += 32) a_round[warp][e] = {rnd}(a_stage[warp][e]);",
                  f"    for (int e = lane; e < {ks * TILE}; e += 32) b_round[warp][e] = {rnd}(b_stage[warp][e]);",
                  "    __syncwarp();",
                  f"    wmma::load_matrix_sync(a_frag, a_round[warp], {ks});",
                  f"    wmma::load_matrix_sync(b_frag, b_round[warp], {TILE});"]
    lines += ["    wmma::mma_sync(acc_frag, a_frag, b_frag, acc_frag);",
              "    __syncwarp();   // every lane is done with the stage before the next step refills it",
              "  }",
              "  wmma::store_matrix_sync(c_tile, acc_frag, 16, wmma::mem_row_major);",
              "  __syncwarp();",
              f"  for (int e = lane; e < {TILE * TILE}; e += 32) {{", *cell("e", "    "),
              f"    if (row >= {m} || col >= {n}) continue;",
              "    const float acc = c_tile[e];",
              f"    {y}[{index}] = acc;"]
    lines += ["  " + line for line in r.epilogue(unit, plan.store)]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"
