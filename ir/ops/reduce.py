"""Reductions over one or more axes."""

from ir.ops.registry import REDUCTION, register

register("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
         "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin",
         kind=REDUCTION)
