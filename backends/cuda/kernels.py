"""The CUDA target's ready-made contraction kernels (`ir/loops/contraction.py`'s `ContractionKernels`):
the contractions the renderer does not derive from their loop nests. Every other contraction stays a
loop nest, which the renderer tiles (`tiled`, `tensor_cores`) or spreads over warps (`warp_rows`) by
its shape; a block-quantized GEMM's loop nest reads B one byte at a time in each output's thread, so
it runs `block_quant`'s kernels instead."""

from __future__ import annotations

import numpy as np

from backends.cuda import block_quant
from ir.loops.contraction import BlockQuantGemmSpec, ContractionSpec, Scratch, WeightLayout


class CudaContractionKernels:
    """`archs`: the architectures the CU is built for (`__dp4a` needs sm_61 or newer in all)."""

    def __init__(self, archs: tuple[str, ...]):
        self.archs = tuple(archs)

    def offers(self, spec: ContractionSpec) -> bool:
        return isinstance(spec, BlockQuantGemmSpec) and block_quant.block_quant_fits(spec, self.archs)

    def weight_layout(self, spec: ContractionSpec) -> WeightLayout | None:
        return block_quant.weight_layout(spec)

    def pack_weight(self, spec: ContractionSpec, weight) -> np.ndarray:
        return block_quant.pack_block_quant(spec, weight)

    def scratch(self, spec: ContractionSpec) -> tuple[Scratch, ...]:
        return block_quant.scratch(spec)

