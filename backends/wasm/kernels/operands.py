"""Where a kernel's operands lie in linear memory, and how they are laid out beyond what the spec
says: the byte offsets and strides the WAT renderers bake into their code as constants."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmOffsets:
    """A GEMM's operands: A, B packed into panels (`gemm.pack_b`), C, and the bias and residual when
    the spec's epilogue has them. `a_scratch`: where the kernel may copy blocks of A
    (`gemm_scratch_bytes(m, k, tile_rows)` bytes) so that a tile reads its rows' values for one k as
    one v128, used whenever M is more than one tile; None: A is read in place."""
    a: int
    b_packed: int
    c: int
    bias: int | None = None
    residual: int | None = None
    a_scratch: int | None = None


@dataclass(frozen=True)
class GemmLayout:
    """How a GEMM's operands sit in memory where that is not the plain case (dense row-major A and
    C, a column bias, one tile height of 4 rows, A not packed).
    - `lda`: A's row stride in elements (default K, or M with the spec's `trans_a`); `ldc`: C's and
      the residual's (default N). The residual may be C itself (read before the tile is written).
    - `batch_strides = (a, b, c)` in bytes for a batched spec (0 broadcasts an operand; default
      dense). The residual follows C's stride; a column bias is shared, a per-row bias moves on by
      M floats per batch (a grouped Conv's groups each have their own channels' bias).
    - `bias_per_row`: the bias is M floats broadcast over columns (a Conv's per-channel bias when C
      is its NCHW output) instead of N broadcast over rows.
    - `tile_rows`: rows per register tile, 1 to 4 (None: the kernel's default, 4).
    - `a_packed`: A already is `pack_a(A)` (a weight packed at compile time): the kernel reads it as
      it reads its scratch blocks and packs nothing; only where `packs_a(m, features, tile_rows)`.
      A's batch stride is then `packed_a_size(m, k)`.
    - `c_shift`: the function takes one i32 parameter, a byte offset added to C's and the
      residual's offsets (a Conv's chunk of output rows: one function for every chunk)."""
    lda: int | None = None
    ldc: int | None = None
    batch_strides: tuple[int, int, int] | None = None
    bias_per_row: bool = False
    tile_rows: int | None = None
    a_packed: bool = False
    c_shift: bool = False
    # B's quantization block along K where it is stored in MatMulNBits' blocks (b_format "q4"/"q8")
    b_block: int = 0


@dataclass(frozen=True)
class ConvOffsets:
    """A Conv's operands: input, weight (as `pack_conv_weight` laid it out), output, the scratch
    (`conv_scratch_bytes`), and the per-channel bias and the residual when there are any."""
    x: int
    w: int
    y: int
    scratch: int
    bias: int | None = None
    residual: int | None = None
