"""Graph passes. A pipeline is a plain list of passes."""

from passes.base import Pass, PassRecord, run_pipeline
from passes.eliminate_common_subexpressions import EliminateCommonSubexpressions
from passes.eliminate_dead_code import EliminateDeadCode
from passes.fold_constants import FoldConstants
from passes.infer_shapes import InferShapes
from passes.simplify import Simplify


def optimize_pipeline(input_shapes=None, dims=None, require_static=False) -> list[Pass]:
    """The graph-level optimisations every command runs before partitioning."""
    return [
        InferShapes(input_shapes or {}, dims or {}, require_static=require_static),
        FoldConstants(),
        Simplify(),
        EliminateCommonSubexpressions(),
        FoldConstants(),
        EliminateDeadCode(),
    ]


__all__ = ["Pass", "PassRecord", "run_pipeline", "optimize_pipeline", "InferShapes", "FoldConstants",
           "Simplify", "EliminateCommonSubexpressions", "EliminateDeadCode"]
