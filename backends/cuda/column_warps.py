"""The launch shape the CUDA GEMVs over narrow weights share (`block_quant.py`, `narrow_gemv.py`): one
warp per column of B and up to `MAX_ROWS` rows of A, `WARPS` columns a block. The lanes stride the
column (by blocks of codes, or by 16-byte vectors), each widened value serving all the warp's rows;
the lanes' float32 sums `acc[r]` meet through `__shfl_xor_sync` and lane 0 stores them."""

from __future__ import annotations

WARPS = 4            # columns per block, one warp each
MAX_ROWS = 4         # rows of A one warp multiplies with each widened value of its column
LANE_SUM = "for (int offset = 16; offset > 0; offset >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);"


def rows_per_warp(m: int) -> int:
    return min(m, MAX_ROWS)


def column_launch(name: str, m: int, n: int) -> tuple[str, list[int], list[int], int]:
    """(kernel, grid, block, useful threads) of the GEMV launch of an m x n output."""
    return name, [-(-n // WARPS), -(-m // rows_per_warp(m)), 1], [32 * WARPS, 1, 1], m * n


def column_prologue(m: int, n: int, pointers: list[str]) -> list[str]:
    """The kernel's first lines: the warp's column `col` (a warp past N leaves whole), `pointers`
    (lines that may use `col`), its rows `row[r]` from `row0` and their zeroed sums `acc[r]`."""
    rows = rows_per_warp(m)
    return ["  const int lane = threadIdx.x & 31;",
            f"  const int col = blockIdx.x * {WARPS} + (threadIdx.x >> 5), row0 = blockIdx.y * {rows};",
            f"  if (col >= {n}) return;   // whole warps leave together",
            *pointers,
            # Rows past M (the last warp's) repeat row M - 1: the loop stays branch-free, the store skips them.
            f"  int row[{rows}];",
            f"  for (int r = 0; r < {rows}; ++r) row[r] = min(row0 + r, {m - 1});",
            f"  float acc[{rows}];",
            f"  for (int r = 0; r < {rows}; ++r) acc[r] = 0.0f;"]
