"""The layouts the GEMM kernels read their operands in, made at compile time: B (a constant weight)
in 16-column panels, A (a Conv's weight given as A) in row tiles by K blocks, and the K blocking
they share (backends/wasm/gemm.py renders the kernels that read them)."""

from __future__ import annotations

import numpy as np

from backends.wasm.kernels.microkernel import PANEL, PANEL_BYTES

K_BLOCK = 128
# Rows per register tile: 4 by default, the only height whose A values for one k are a whole v128
# in packed A (see kernels/microkernel.py).
TILE_ROWS = 4


def packed_b_size(k: int, n: int) -> int:
    return -(-n // PANEL) * k * PANEL_BYTES


def pack_b(b: np.ndarray, trans_b: bool = False) -> bytes:
    """B (K x N; N x K with trans_b) as little-endian float32 panels [ceil(N/16)][K][16]."""
    b = np.asarray(b, dtype=np.float32)
    if b.ndim != 2:
        raise ValueError(f"pack_b expects a matrix, got shape {b.shape}")
    if trans_b:
        b = b.T
    k, n = b.shape
    panels = -(-n // PANEL)
    padded = np.zeros((k, panels * PANEL), dtype="<f4")
    padded[:, :n] = b
    return padded.reshape(k, panels, PANEL).transpose(1, 0, 2).tobytes()


def k_block_size(k: int) -> int:
    """K columns per block (of a product of more than one row tile): K_BLOCK, or all of K when the
    last block would be shorter than a quarter of one. Each block is a pass over C, and a short last
    one costs a pass for little work: measured (relaxed SIMD, wasmtime 50, CPU time, median of 9
    interleaved rounds, blocks of 128 -> one block) Conv 7x7s2 3->96 at 224 (k = 147) 9.68 -> 8.33 ms,
    3->64 7.39 -> 6.41; GEMM GFLOP/s 512x512x150 47.5 -> 48.9, 128x384x150 + gelu 39.0 -> 40.4,
    64x3136x147 + relu 45.7 -> 46.9, 256x784x144 45.9 -> 46.5, 1024x256x140 46.8 -> 47.2."""
    return k if k < K_BLOCK + K_BLOCK // 4 else K_BLOCK


def packs_a(m: int, features, tile_rows: int = TILE_ROWS) -> bool:
    """Whether the SIMD kernel reads A packed (from its scratch, or `pack_a`'s layout with `a_packed`):
    more than one row tile."""
    return "simd" in frozenset(features) and m > tile_rows


def packed_a_size(m: int, k: int, tile_rows: int = TILE_ROWS) -> int:
    return -(-m // tile_rows) * tile_rows * k * 4


def pack_a(a: np.ndarray, tile_rows: int = TILE_ROWS) -> np.ndarray:
    """A (M x K, more than one tile of rows) as the tiles read it packed: K blocks of `k_block_size(K)`, each
    [ceil(M/tile_rows)][klen][tile_rows], the rows past M zero. Block k0 starts at k0 * Mp floats (Mp:
    M rounded up to the tile), the group of row i at i * klen inside it."""
    a = np.asarray(a, dtype=np.float32)
    m, k = a.shape
    rows = -(-m // tile_rows) * tile_rows
    padded = np.zeros((rows, k), np.float32)
    padded[:m] = a
    kc = k_block_size(k)
    blocks = [padded[:, k0:k0 + kc].reshape(rows // tile_rows, tile_rows, -1).transpose(0, 2, 1).ravel()
              for k0 in range(0, k, kc)]
    return np.concatenate(blocks)
