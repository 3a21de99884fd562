"""Linear algebra: Einsum, and determinants of small matrices."""

import numpy as np

from ir.loops.expr import logical_and, lt, ne, select, unary
from ir.ops.registry import CONTRACTION, OTHER, lowering, register

register("Det", kind=OTHER)
register("Einsum", kind=CONTRACTION)


@lowering("loops", "Det")
def _det(b, node):
    """Gaussian elimination with partial pivoting on a copy of each matrix: the determinant is the
    product of the pivots, negated once per row swap."""
    x, y = b.input(node, 0), b.output(node)
    *batch, n, _ = x.shape
    count = int(np.prod(batch, dtype=np.int64))
    xv, yv = x.view((count, n, n)), y.view((count,))
    a = b.temp(x.dtype, (n, n), "lu")
    t = x.compute_type
    with b.loop(count, "m") as m:
        with b.loop(n, "i") as i, b.loop(n, "j") as j:
            b.store(a, (i, j), xv[m, i, j])
        det = b.local(t, 1.0, "det")
        with b.loop(n, "k") as k:
            pivot_row = b.local("i32", k, "pivot_row")
            with b.loop(n, "i") as i:
                better = logical_and(lt(k, i), lt(unary("abs", a[pivot_row, k]), unary("abs", a[i, k])))
                b.assign(pivot_row, select(better, i, pivot_row))
            swapped = b.local("i32", ne(pivot_row, k), "swapped")
            with b.loop(n, "j") as j:
                top = b.local(t, a[k, j], "top")
                b.store(a, (k, j), a[pivot_row, j])
                b.store(a, (pivot_row, j), top)
            pivot = b.local(t, a[k, k], "pivot")
            b.assign(det, select(swapped, -det, det) * pivot)
            with b.loop(n, "i") as i:
                with b.when(logical_and(lt(k, i), ne(pivot, 0.0))):
                    factor = b.local(t, a[i, k] / pivot, "factor")
                    with b.loop(n, "j") as j:
                        b.store(a, (i, j), a[i, j] - factor * a[k, j])
        b.store(yv, (m,), det)


@lowering("loops", "Einsum")
def _einsum(b, node):
    """One loop per letter: the output's letters outside, the summed ones inside an accumulator."""
    ins = [b.input(node, i) for i in range(len(node.inputs))]
    terms, rhs = _einsum_terms(node.attrs["equation"], [len(x.shape) for x in ins])
    y = b.output(node)
    extent = {}
    for term, x in zip(terms, ins):
        for c, d in zip(term, x.shape):
            extent[c] = max(extent.get(c, 1), d)
    summed = sorted(set("".join(terms)) - set(rhs))
    t = y.compute_type
    with b.loops([extent[c] for c in rhs], "o") as out_idx:
        var = dict(zip(rhs, out_idx))
        acc = b.local(t, 0, "acc")
        with b.loops([extent[c] for c in summed], "s") as sum_idx:
            var.update(zip(summed, sum_idx))
            product = None
            for term, x in zip(terms, ins):
                v = x[tuple(var[c] if d != 1 else 0 for c, d in zip(term, x.shape))] if term else x.at(0)
                product = v if product is None else product * v
            b.assign(acc, acc + product)
        b.store(y, tuple(out_idx), acc)


def _einsum_terms(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """The equation's input terms and output term, with each `...` spelled out as letters the
    equation does not use (right-aligned across terms, as the ellipsis broadcasts), and the implicit
    output (no `->`) made explicit: the ellipsis, then the letters used once, sorted."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    spans = [rank - (len(t) - 3) if "..." in t else 0 for t, rank in zip(terms, ranks)]
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in equation]
    ellipsis = "".join(free[:max(spans, default=0)])
    terms = [t.replace("...", ellipsis[len(ellipsis) - n:] if n else "") for t, n in zip(terms, spans)]
    if not arrow:
        letters = "".join(terms)
        rhs = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ellipsis))
    return terms, rhs.replace("...", ellipsis)
