"""Ops defined by positions rather than values: triangles, identity-like matrices, one-hot
encodings, running sums and top-k selection."""

import numpy as np

from ir.loops.expr import cast, eq, ge, gt, le, logical_and, logical_or, lt, select
from ir.ops.registry import OTHER, lowering, register

register("Trilu", "EyeLike", "OneHot", "CumSum", "CumProd", "TopK", "Range", kind=OTHER)


@lowering("loops", "Trilu")
def _trilu(b, node):
    x, y = b.input(node, 0), b.output(node)
    k = int(b.const_input(node, 1).reshape(-1)[0]) if b.const_input(node, 1) is not None else 0
    upper = bool(node.attrs.get("upper", 1))
    with b.loops(y.shape) as idx:
        row, col = idx[-2], idx[-1]
        keep = ge(col - row, k) if upper else le(col - row, k)
        b.store(y, idx, select(keep, x[tuple(idx)], 0))


@lowering("loops", "EyeLike")
def _eye_like(b, node):
    y = b.output(node)
    k = int(node.attrs.get("k", 0))
    with b.loops(y.shape) as (i, j):
        b.store(y, (i, j), cast(eq(j - i, k), y.compute_type))


@lowering("loops", "OneHot")
def _one_hot(b, node):
    """The depth need not be a constant: the output's shape already holds it, and the value only
    wraps negative indices, so it is read at run time like any input."""
    ind, values, y = b.input(node, 0), b.input(node, 2), b.output(node)
    depth_value = node.inputs[1]
    depth = int(np.asarray(depth_value.const).reshape(-1)[0]) if depth_value.is_const else \
        cast(b.input(node, 1).at(0), "i64")
    axis = int(node.attrs.get("axis", -1)) % len(y.shape)
    with b.loops(y.shape) as idx:
        at = ind[tuple(idx[:axis] + idx[axis + 1:])] if len(ind.shape) else ind.at(0)
        at = cast(at, "i64") if at.type not in ("i64",) else at
        at = select(lt(at, 0), at + depth, at)
        b.store(y, idx, select(eq(at, cast(idx[axis], "i64")), values.at(1), values.at(0)))


@lowering("loops", "CumSum", "CumProd")
def _cumulative(b, node):
    x, y = b.input(node, 0), b.output(node)
    axis = int(b.const_input(node, 1).reshape(-1)[0]) % len(x.shape)
    exclusive, reverse = bool(node.attrs.get("exclusive", 0)), bool(node.attrs.get("reverse", 0))
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    d, inner = x.shape[axis], int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    xv, yv = x.view((outer, d, inner)), y.view((outer, d, inner))
    product = node.op_type == "CumProd"
    with b.loop(outer, "o") as o, b.loop(inner, "i") as i:
        acc = b.local(y.compute_type, 1 if product else 0, "acc")
        with b.loop(d, "k") as k:
            at = (d - 1 - k) if reverse else k
            step = acc * xv[o, at, i] if product else acc + xv[o, at, i]
            if exclusive:
                b.store(yv, (o, at, i), acc)
                b.assign(acc, step)
            else:
                b.assign(acc, step)
                b.store(yv, (o, at, i), acc)


@lowering("loops", "TopK")
def _top_k(b, node):
    """k rounds of selection per row: each picks the best value not yet taken (lowest index first
    among equals), which is the sorted order onnxruntime returns."""
    x, values, indices = b.input(node, 0), b.output(node, 0), b.output(node, 1)
    axis = int(node.attrs.get("axis", -1)) % len(x.shape)
    largest = bool(node.attrs.get("largest", 1))
    k = values.shape[axis]
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    d, inner = x.shape[axis], int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    xv, vv, iv = x.view((outer, d, inner)), values.view((outer, k, inner)), indices.view((outer, k, inner))
    taken = b.temp("uint8", (d,), "taken")
    better = gt if largest else lt
    with b.loop(outer, "o") as o, b.loop(inner, "i") as i:
        b.fill(taken, 0)
        with b.loop(k, "r") as r:
            best = b.local(x.compute_type, xv[o, 0, i], "best")
            where = b.local("i32", -1, "where")
            with b.loop(d, "j") as j:
                v = xv[o, j, i]
                free = eq(taken[j], 0)
                take = b.local("i32", logical_and(free, logical_or(lt(where, 0), better(v, best))), "take")
                b.assign(best, select(take, v, best))
                b.assign(where, select(take, j, where))
            b.store(taken, (where,), 1)
            b.store(vv, (o, r, i), best)
            b.store(iv, (o, r, i), where)


@lowering("loops", "Range")
def _range(b, node):
    """Once the output's length is static (inferred from constant operands, or declared by the
    model), start and delta may be run-time values: element i is start + i * delta."""
    y = b.output(node)
    start, delta = (_scalar(b, node, i, y.compute_type) for i in (0, 2))
    with b.loop(y.numel) as i:
        b.store_flat(y, i, cast(i, y.compute_type) * delta + start)


def _scalar(b, node, i: int, type: str):
    value = node.inputs[i]
    if value.is_const:
        return np.asarray(value.const).reshape(-1)[0].item()
    return cast(b.input(node, i).at(0), type)
