"""Which loops of a loop nest may run on threads: CUDA threads (backends/cuda), or the parts of a
wasm kernel that several threads share (backends/wasm/kernel_parts.py).

A top-level loop nest becomes one kernel launch. Its perfect chain of loops (each body a single loop)
is searched, outermost first, for loops whose iterations write disjoint memory: each such loop
becomes a thread dimension, the others stay loops inside each thread in their original order. For a
MatMul nest (i, k, j) that picks i and j and leaves each thread the k reduction, which is legal
because a thread still adds its k terms in the original order and no two threads touch the same
output element.

The test is deliberately simple and conservative (stores affine in the loop variables, one affine
form per written storage, a mixed-radix layout that makes it injective; loads of a written storage
only from the thread's own cells); a nest that fails it runs serially, which is always correct.
"""

from __future__ import annotations

from dataclasses import dataclass

from codegen.affine import Affine, affine
from ir.loops.program import Loop, Stmt, Store, loads_in, walk_stmts


@dataclass
class ParallelNest:
    threads: list[Loop]     # loops mapped to threads, outermost first (the last varies fastest)
    serial: list[Loop]      # chain loops each thread still runs, in their original order
    body: list[Stmt]        # the innermost chain loop's body

    @property
    def thread_count(self) -> int:
        n = 1
        for loop in self.threads:
            n *= loop.extent
        return n


def _injective(form: Affine, extents: dict[int, int]) -> bool:
    """Sufficient: sorted by |coefficient|, each exceeds the span of all smaller terms."""
    span = 0
    for uid, coef in sorted(form[0].items(), key=lambda t: abs(t[1])):
        if extents.get(uid) == 1:
            continue      # a loop of one iteration adds nothing, whatever its coefficient
        if uid not in extents or abs(coef) <= span:
            return False
        span += abs(coef) * (extents[uid] - 1)
    return True


def _signature(form: Affine, thread_vars: set[int], extents: dict[int, int]):
    """What identifies the cells a thread touches: thread coefficients exactly, the rest as
    (coefficient, extent) pairs (two loops over the same range cover the same cells)."""
    own = tuple(sorted((uid, c) for uid, c in form[0].items() if uid in thread_vars))
    rest = tuple(sorted((c, extents.get(uid, -1)) for uid, c in form[0].items() if uid not in thread_vars))
    return own, rest, form[1]


def threads_are_independent(thread_loops: list[Loop], chain: list[Loop], body: list[Stmt]) -> bool:
    extents = {loop.var.uid: loop.extent for loop in chain}
    for s in walk_stmts(body):
        if isinstance(s, Loop):
            extents[s.var.uid] = s.extent
    thread_vars = {loop.var.uid for loop in thread_loops}
    stores: dict[int, list[Affine]] = {}
    for s in walk_stmts(body):
        if isinstance(s, Store):
            form = affine(s.index)
            if form is None or not _injective(form, extents):
                return False
            if any(form[0].get(uid, 0) == 0 for uid in thread_vars):
                return False      # a thread loop the store ignores: threads would collide
            stores.setdefault(id(s.buffer.storage), []).append(form)
    written = {}
    for key, forms in stores.items():
        signatures = {_signature(f, thread_vars, extents) for f in forms}
        if len(signatures) != 1:
            return False
        written[key] = signatures.pop()
    for x in loads_in(body):
        if id(x.buffer.storage) in written:
            form = affine(x.index)
            if form is None or _signature(form, thread_vars, extents) != written[id(x.buffer.storage)]:
                return False
    return True


def plan_parallel(stmt: Stmt) -> ParallelNest | None:
    """Thread loops for a top-level statement, or None when it must run serially."""
    if not isinstance(stmt, Loop) or stmt.extent <= 0:
        return None
    chain = [stmt]
    while len(chain[-1].body) == 1 and isinstance(chain[-1].body[0], Loop) and chain[-1].body[0].extent > 0:
        chain.append(chain[-1].body[0])
    body = chain[-1].body
    threads: list[Loop] = []
    for loop in chain:
        # A loop of one iteration is a thread dimension of size one: nothing to prove.
        proven = [t for t in threads if t.extent > 1]
        if loop.extent == 1 or threads_are_independent(proven + [loop], chain, body):
            threads.append(loop)
    if all(loop.extent == 1 for loop in threads):
        return None
    return ParallelNest(threads, [loop for loop in chain if loop not in threads], body)
