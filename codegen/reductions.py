"""Reductions: assignments that fold one more term into an accumulator, `acc = acc op e`.

Both backends run such a loop's terms on several lanes at once (four SIMD lanes in WebAssembly, the
32 lanes of a warp in CUDA): each lane starts from op's identity, and the lanes' partial results are
combined after the loop. That reorders the terms, so it is only done for an associative op and an
`e` that does not read the accumulator. Which types and ops a target can carry this way (and the
identities it spells) stay with the target.
"""

from __future__ import annotations

from typing import NamedTuple

from ir.loops.expr import Binary, Expr, Local, uses
from ir.loops.program import Assign, Stmt, walk_stmts

ASSOCIATIVE = ("add", "mul", "max", "min")


class ReductionStep(NamedTuple):
    op: str             # one of ASSOCIATIVE
    operand: Expr       # the term folded in, free of the accumulator


def reduction_step(s: Assign) -> ReductionStep | None:
    """What `s` folds in when it is `acc = acc op e` or `acc = e op acc`, else None."""
    v = s.value
    if not isinstance(v, Binary) or v.op not in ASSOCIATIVE:
        return None
    if v.a is s.local and not uses(v.b, s.local):
        return ReductionStep(v.op, v.b)
    if v.b is s.local and not uses(v.a, s.local):
        return ReductionStep(v.op, v.a)
    return None


def accumulators(stmts: list[Stmt]) -> dict[int, tuple[Local, str]] | None:
    """uid -> (local, op) for every local `stmts` assign (nested blocks included), when each of
    those assignments is a reduction step and each local is folded with one op; else None."""
    found: dict[int, tuple[Local, str]] = {}
    for s in walk_stmts(stmts):
        if isinstance(s, Assign):
            step = reduction_step(s)
            if step is None or found.get(s.local.uid, (s.local, step.op))[1] != step.op:
                return None
            found[s.local.uid] = (s.local, step.op)
    return found
