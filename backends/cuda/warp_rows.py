"""Warp-cooperative rows: one warp per row for nests that reduce along the row (Softmax, LayerNorm,
ReduceSum/Mean/Max/..., ReduceLogSumExp).

`parallelize` gives such a nest one thread per row, each looping over the whole row. When every loop
of the row body is lane-stridable (its stores touch distinct cells per iteration; its local updates
are `acc = acc op e` with op add/mul/max/min) the row runs on a warp instead: the 32 lanes split each
loop's iterations, every accumulator starts each lane from op's identity and is combined across the
warp with `__shfl_xor_sync` (a butterfly, so every lane ends with the total), then folded into its
value from before the loop. A `__syncwarp` after each loop that stores makes the row's writes visible
to every lane before the next loop reads them; a store outside any loop is done by lane 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from codegen.parallel_loops import ParallelNest, threads_are_independent
from codegen.reductions import accumulators
from ir.loops.expr import Local, walk
from ir.loops.program import Assign, If, Loop, Stmt, Store, walk_stmts

MIN_ROW = 32      # shorter rows leave most lanes idle: one thread per row is as good


@dataclass
class StridedLoop:
    loop: Loop
    accumulators: list[tuple[Local, str]] = field(default_factory=list)   # (local, op)
    stores: bool = False


def _assigns_inside(s: Stmt) -> bool:
    """Whether `s` is an If that assigns a local in one of its branches."""
    return isinstance(s, If) and any(isinstance(x, Assign) for x in walk_stmts(s.body + s.orelse))


def _strided_loop(loop: Loop, row_loops: list[Loop]) -> StridedLoop | None:
    plan = StridedLoop(loop)
    ops = accumulators(loop.body)
    if ops is None:
        return None
    for s in walk_stmts(loop.body):
        if isinstance(s, Store):
            plan.stores = True
        elif _assigns_inside(s):
            return None
    if ops and any(isinstance(x, Local) and x.uid in ops
                   for s in walk_stmts(loop.body) if not isinstance(s, Assign)
                   for e in s.exprs() for x in walk(e)):
        return None   # a partial accumulator must not leak into a store
    if plan.stores and not threads_are_independent([loop], row_loops + [loop], loop.body):
        return None
    plan.accumulators = list(ops.values())
    return plan


def plan_warp_rows(nest: ParallelNest | None) -> dict[int, StridedLoop] | None:
    """id(loop) -> how to stride it, for each top-level loop of the row body; None: not eligible."""
    if nest is None or nest.serial:
        return None
    plans: dict[int, StridedLoop] = {}
    longest = 0
    for s in nest.body:
        if isinstance(s, Loop):
            plan = _strided_loop(s, nest.threads)
            if plan is None:
                return None
            plans[id(s)] = plan
            if plan.accumulators:
                longest = max(longest, s.extent)
        elif _assigns_inside(s):
            return None
    return plans if longest >= MIN_ROW else None
