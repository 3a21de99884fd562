"""Reductions over one or more axes."""

from ir.ops.registry import REDUCTION, register

register("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
         "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin",
         kind=REDUCTION)


# -- lowerings to loop nests: an accumulator per output element over the reduced axes ------------

import numpy as np  # noqa: E402

from ir.loops.expr import cast, eq, gt, logical_or, lt, maximum, minimum, select, unary  # noqa: E402
from ir.ops.registry import lowering  # noqa: E402

# op -> (initial value, step(acc, x), finish(acc, count)); None as initial: the lowest/highest value.
_REDUCERS = {
    "ReduceSum": (0.0, lambda a, x: a + x, lambda a, n: a),
    "ReduceMean": (0.0, lambda a, x: a + x, lambda a, n: a / float(n) if a.type in ("f32", "f64") else a / n),
    "ReduceMax": ("lowest", lambda a, x: maximum(a, x), lambda a, n: a),
    "ReduceMin": ("highest", lambda a, x: minimum(a, x), lambda a, n: a),
    "ReduceProd": (1.0, lambda a, x: a * x, lambda a, n: a),
    "ReduceL1": (0.0, lambda a, x: a + unary("abs", x), lambda a, n: a),
    "ReduceL2": (0.0, lambda a, x: a + x * x, lambda a, n: unary("sqrt", a)),
    "ReduceLogSum": (0.0, lambda a, x: a + x, lambda a, n: unary("log", a)),
    "ReduceSumSquare": (0.0, lambda a, x: a + x * x, lambda a, n: a),
}


def reduced_axes(b, node, rank: int) -> list[int] | None:
    """The axes a reduction runs over (None: nothing, by noop_with_empty_axes)."""
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = b.const_input(node, 1).tolist()
    if not axes:
        return None if node.attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(int(a) % rank for a in axes)


@lowering("loops", *_REDUCERS, "ReduceLogSumExp")
def _reduce(b, node):
    x, y = b.input(node, 0), b.output(node)
    rank = len(x.shape)
    axes = reduced_axes(b, node, rank)
    if axes is None:
        b.copy(y, x)
        return
    keep = [d for d in range(rank) if d not in axes]
    y_full = y.view(tuple(1 if d in axes else x.shape[d] for d in range(rank)))
    count = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    t = y.compute_type
    with b.loops([x.shape[d] for d in keep], "o") as out_idx:
        def at(red_idx):
            idx = [0] * rank
            for d, v in zip(keep, out_idx):
                idx[d] = v
            for d, v in zip(axes, red_idx):
                idx[d] = v
            return idx
        out_at = [v if d in keep else 0 for d, v in zip(range(rank), at([0] * len(axes)))]
        if node.op_type == "ReduceLogSumExp":
            top = b.local(t, float("-inf"), "max")
            with b.loops([x.shape[d] for d in axes], "r") as red:
                b.assign(top, maximum(top, cast(x[tuple(at(red))], t)))
            acc = b.local(t, 0.0, "sum")
            with b.loops([x.shape[d] for d in axes], "r") as red:
                b.assign(acc, acc + unary("exp", cast(x[tuple(at(red))], t) - top))
            b.store(y_full, out_at, top + unary("log", acc))
        else:
            init, step, finish = _REDUCERS[node.op_type]
            if init in ("lowest", "highest"):
                init = extreme_value(x.dtype, init == "lowest")
            acc = b.local(t, init, "acc")
            with b.loops([x.shape[d] for d in axes], "r") as red:
                b.assign(acc, step(acc, cast(x[tuple(at(red))], t)))
            b.store(y_full, out_at, finish(acc, count))


def extreme_value(dtype: str, lowest: bool):
    """The lowest (or highest) value of `dtype`: the identity of a max (or min) reduction."""
    if dtype.startswith("float") or dtype == "bfloat16":
        return float("-inf") if lowest else float("inf")
    info = np.iinfo(np.dtype(dtype if dtype != "bool" else "uint8"))
    return int(info.min if lowest else info.max)


@lowering("loops", "ArgMax", "ArgMin")
def _arg_extreme(b, node):
    x, y = b.input(node, 0), b.output(node)
    rank = len(x.shape)
    axis = int(node.attrs.get("axis", 0)) % rank
    last = bool(node.attrs.get("select_last_index", 0))
    better = gt if node.op_type == "ArgMax" else lt
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    d, inner = x.shape[axis], int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    xv, yv = x.view((outer, d, inner)), y.view((outer, inner))
    with b.loop(outer, "o") as o, b.loop(inner, "i") as i:
        best = b.local(x.compute_type, xv[o, 0, i], "best")
        where = b.local("i32", 0, "where")
        with b.loop(d, "k") as k:
            v = xv[o, k, i]
            take = better(v, best)
            if last:
                take = logical_or(take, eq(v, best))
            b.assign(where, select(take, k, where))
            b.assign(best, select(take, v, best))
        b.store(yv, (o, i), where)

