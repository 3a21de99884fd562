"""Graph passes. A pipeline is a plain list of passes."""

from passes.base import Pass, PassRecord, run_pipeline
from passes.eliminate_common_subexpressions import EliminateCommonSubexpressions
from passes.eliminate_dead_code import EliminateDeadCode
from passes.expand_ops import ExpandOps
from passes.fold_constants import FoldConstants
from passes.fold_qdq import FoldQDQ
from passes.freeze_inputs import FreezeInputs
from passes.hoist_scalars import HoistScalarOperands
from passes.infer_shapes import InferShapes
from passes.simplify import Simplify


def optimize_pipeline(input_shapes=None, dims=None, require_static=False, frozen_inputs=None) -> list[Pass]:
    """The graph-level optimisations every command runs before partitioning."""
    return [
        # Only when asked, so a plain build's pass list (shown by `cortex inspect`) stays as it was.
        *([FreezeInputs(frozen_inputs)] if frozen_inputs else []),
        ExpandOps(),
        # The DequantizeLinear of quantized weights stay until fold-qdq has turned what it can into
        # integer ops; the second folding makes float constants of the rest.
        InferShapes(input_shapes or {}, dims or {}, require_static=require_static, keep_dequantized_weights=True),
        FoldConstants(keep_dequantized_weights=True),
        FoldQDQ(),
        Simplify(),
        EliminateCommonSubexpressions(),
        FoldConstants(),
        EliminateDeadCode(),
        # Scalar operands (a dynamic quantisation's a_scale * b_scale) before the products that
        # read them, so that the products' kernels may take them in (passes/fuse_groups.py).
        HoistScalarOperands(),
    ]


__all__ = ["Pass", "PassRecord", "run_pipeline", "optimize_pipeline", "FreezeInputs", "ExpandOps", "InferShapes", "FoldConstants", "FoldQDQ",
           "Simplify", "EliminateCommonSubexpressions", "EliminateDeadCode", "HoistScalarOperands"]
