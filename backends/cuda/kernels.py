"""The CUDA target's ready-made contraction kernels (`ir/loops/contraction.py`'s `ContractionKernels`):
the contractions the renderer does not derive from their loop nests. Every other contraction stays a
loop nest, which the renderer tiles (`tiled`, `tensor_cores`) or spreads over warps (`warp_rows`) by
its shape. Two kinds of B are read as stored instead, by a warp per column: a block-quantized GEMM's
4- and 8-bit codes (`block_quant`; its loop nest reads B one byte at a time in each output's thread),
and a narrow variant's bf16, fp16 or int8 weight in a product of few rows (`narrow_gemv`; its loop
nest would read the float32 copy that the graph's widening writes on every call). A float32 GEMM is
not offered: its loop nests run on the renderer's tiles and tensor cores.

`launches` and `render_kernel` are the renderer's two questions about an `Intrinsic`: which launches
it takes, and their functions' source."""

from __future__ import annotations

import numpy as np

from backends.cuda import block_quant, narrow_gemv
from ir.loops.contraction import BlockQuantGemmSpec, ContractionSpec, GemmSpec, Scratch, WeightLayout
from ir.loops.program import Intrinsic


class CudaContractionKernels:
    """`archs`: the architectures the CU is built for (`__dp4a` needs sm_61 or newer in all)."""

    def __init__(self, archs: tuple[str, ...]):
        self.archs = tuple(archs)

    def offers(self, spec: ContractionSpec) -> bool:
        if isinstance(spec, GemmSpec):
            return narrow_gemv.narrow_gemv_fits(spec)
        return isinstance(spec, BlockQuantGemmSpec) and block_quant.block_quant_fits(spec, self.archs)

    def weight_layout(self, spec: ContractionSpec) -> WeightLayout | None:
        if isinstance(spec, GemmSpec):
            return narrow_gemv.weight_layout(spec)
        return block_quant.weight_layout(spec)

    def pack_weight(self, spec: ContractionSpec, weight) -> np.ndarray:
        if isinstance(spec, GemmSpec):
            return narrow_gemv.pack_narrow_columns(spec, weight)
        return block_quant.pack_block_quant(spec, weight)

    def scratch(self, spec: ContractionSpec) -> tuple[Scratch, ...]:
        if isinstance(spec, GemmSpec):
            return ()
        return block_quant.scratch(spec)


def launches(name: str, spec: ContractionSpec) -> list[tuple[str, list[int], list[int], int]]:
    """(kernel, grid, block, useful threads) of each launch of the kernel for `spec`, in order."""
    if isinstance(spec, GemmSpec):
        return narrow_gemv.launches(name, spec)
    return block_quant.launches(name, spec)


def render_kernel(r, unit, call: Intrinsic) -> str:
    """The functions of `launches`, in order, for one `Intrinsic`; `r` is the CudaRenderer."""
    if isinstance(call.spec, GemmSpec):
        return narrow_gemv.render_narrow_gemv(r, unit, call)
    return block_quant.render_block_quant(r, unit, call)
