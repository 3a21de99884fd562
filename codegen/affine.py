"""Affine forms of index expressions: sum(coefficient * loop variable) + constant.

One analysis serves two questions. The CUDA parallelizer, fuser and tiler need an index's exact form
over every loop variable (to prove that threads write disjoint cells); the WebAssembly vectoriser
needs only how far an index moves when one loop variable grows (`stride_of`), and there any part of
the index that does not involve that variable (a gathered offset, a local) is just some constant.
`affine` takes which sub-expressions may stand for such an unknown constant.
"""

from __future__ import annotations

from collections.abc import Callable

from ir.loops.expr import Binary, Cast, Const, Expr, Var, uses

# var uid -> coefficient (never zero), then the constant term: None when the form has an opaque,
# unknown but fixed part (only where `affine` was told it may treat a sub-expression so).
Affine = tuple[dict[int, int], int | None]
_INTEGER = ("i32", "i64")


def _never(e: Expr) -> bool:
    return False


def affine(e: Expr, opaque: Callable[[Expr], bool] = _never) -> Affine | None:
    """`e` as an affine form over loop variables, or None if it is not one. A sub-expression that is
    not affine but satisfies `opaque` counts as an unknown constant (by default none does)."""
    form = _structural(e, opaque)
    if form is None and opaque(e):
        return {}, None
    return form


def _structural(e: Expr, opaque: Callable[[Expr], bool]) -> Affine | None:
    if isinstance(e, Const):
        return ({}, int(e.value)) if isinstance(e.value, int) else None
    if isinstance(e, Var):
        return {e.uid: 1}, 0
    if isinstance(e, Cast) and e.type in _INTEGER and e.a.type in _INTEGER:
        return affine(e.a, opaque)
    if not isinstance(e, Binary) or e.op not in ("add", "sub", "mul"):
        return None
    a, b = affine(e.a, opaque), affine(e.b, opaque)
    if a is None or b is None:
        return None
    if e.op == "mul":
        return _product(a, b)
    sign = 1 if e.op == "add" else -1
    terms = dict(a[0])
    for v, coef in b[0].items():
        terms[v] = terms.get(v, 0) + sign * coef
    constant = None if a[1] is None or b[1] is None else a[1] + sign * b[1]
    return {v: c for v, c in terms.items() if c}, constant


def _product(a: Affine, b: Affine) -> Affine | None:
    """a * b while one side is a plain constant; a product of two variable terms is not affine."""
    if a[0] and b[0]:
        return None
    (terms, c), k = (a, b[1]) if not b[0] else (b, a[1])
    if k is None:
        # an unknown factor leaves the variable terms without a known coefficient
        return ({}, None) if not terms else None
    return {v: coef * k for v, coef in terms.items() if coef * k}, None if c is None else c * k


def stride_of(index: Expr, var: Var) -> int | None:
    """How far `index` moves when `var` grows by one, if that is a constant (None: it is not affine
    in `var`, e.g. a gathered index). Whatever does not involve `var` only shifts the index."""
    form = affine(index, lambda e: not uses(e, var))
    return None if form is None else form[0].get(var.uid, 0)
