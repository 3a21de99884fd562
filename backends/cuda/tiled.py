"""Shared-memory tiled contractions: MatMul, Gemm and (as implicit GEMM) Conv.

`parallelize` leaves a contraction as one thread per output element with the reduction loops inside
(`y = fma(a, b, y)` over k). When the innermost body is exactly that store, the nest is a GEMM in
disguise: the thread loops that only `a` reads are the rows (M), those only `b` reads are the
columns (N), the others are batch, and the serial loops flattened are K (for a Conv: input channel
and kernel taps, which makes this an implicit-GEMM convolution). A 16x16 block then stages 16x16
tiles of `a` and `b` in shared memory per step of K. Each output still accumulates its k terms in
the original order starting from y's value, so the result is bit-identical to the untiled nest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from codegen.affine import affine
from ir.loops.expr import Expr, Fma, Load, Var, walk
from ir.loops.program import Loop, Store

from codegen.parallel_loops import ParallelNest

TILE = 16


@dataclass
class TiledContraction:
    store: Store
    a: Expr                   # the operand indexed by rows and K
    b: Expr                   # the operand indexed by K and columns
    rows: list[Loop]          # M, outermost first
    cols: list[Loop]          # N
    batch: list[Loop]
    k: list[Loop]             # K: the serial loops, outermost first

    @staticmethod
    def extent(loops: list[Loop]) -> int:
        return math.prod(loop.extent for loop in loops)


def _vars(e: Expr) -> set[int]:
    return {x.uid for x in walk(e) if isinstance(x, Var)}


def _only_in(threads: list[Loop], mine: set[int], other: set[int]) -> list[Loop]:
    """The thread loops (of more than one iteration) that one operand indexes and the other does not."""
    return [t for t in threads if t.var.uid in mine and t.var.uid not in other and t.extent > 1]


def plan_tiled(nest: ParallelNest | None) -> TiledContraction | None:
    if nest is None or not nest.serial or len(nest.body) != 1 or not isinstance(nest.body[0], Store):
        return None
    store = nest.body[0]
    value = store.value
    if store.buffer.compute_type != "f32" or not isinstance(value, Fma):
        return None
    acc = value.c
    if not (isinstance(acc, Load) and acc.buffer.storage is store.buffer.storage
            and affine(acc.index) == affine(store.index) and affine(store.index) is not None):
        return None
    k_vars = {loop.var.uid for loop in nest.serial}
    a, b = value.a, value.b
    used_a, used_b = _vars(a), _vars(b)
    rows, cols = _only_in(nest.threads, used_a, used_b), _only_in(nest.threads, used_b, used_a)
    if not rows or not cols:
        a, b, used_a, used_b = b, a, used_b, used_a
        rows, cols = cols, rows
    if not rows or not cols or not (k_vars & used_a) or not (k_vars & used_b) or _vars(store.index) & k_vars:
        return None
    if any(isinstance(x, Load) and x.buffer.storage is store.buffer.storage for x in [*walk(a), *walk(b)]):
        return None
    batch = [t for t in nest.threads if t not in rows and t not in cols]
    plan = TiledContraction(store, a, b, rows, cols, batch, list(nest.serial))
    if plan.extent(batch) > 65535:
        return None     # gridDim.z
    if plan.extent(rows) < TILE or plan.extent(cols) < TILE or plan.extent(plan.k) < TILE:
        return None     # too small to pay for the staging
    return plan
