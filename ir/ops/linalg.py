"""Linear algebra on small matrices."""

import numpy as np

from ir.loops.expr import logical_and, lt, ne, select, unary
from ir.ops.registry import OTHER, lowering, register

register("Det", kind=OTHER)


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
