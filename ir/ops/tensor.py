"""Layout ops (data movement without arithmetic) and shape computations."""

from ir.ops.registry import ELEMENTWISE, LAYOUT, SHAPE, register, view_ops

# Views: row-major data is unchanged by these, so the output is the input's storage.
# A bounded value (ir/bounds.py) keeps its padding through any of these whose output still has the
# dynamic axis: the shape rules refuse the rest (a Slice or Concat along that axis).
register("Reshape", "Flatten", "Squeeze", "Unsqueeze", kind=LAYOUT, view=True, keeps_bound=True, quantized_exact=True)
# Identity is a view too, and also the simplest one-position map: elementwise for fusion.
register("Identity", kind=ELEMENTWISE, view=True)
register("Transpose", "Concat", "Slice", kind=LAYOUT, keeps_bound=True, quantized_exact=True)
register("DepthToSpace", "SpaceToDepth", kind=LAYOUT, quantized_exact=True)
# GatherND by selected indices (x[mask] in torch: NonZero -> Transpose -> GatherND) keeps the bound
# of the indices' leading axes, as Gather does.
register("Split", "GatherElements", "GatherND", "Expand", "Tile", kind=LAYOUT, keeps_bound=True)
register("ScatterElements", "ScatterND", "Scatter", "TensorScatter", "Pad", "ReverseSequence",
         "ConstantOfShape", kind=LAYOUT)
register("Shape", "Size", kind=SHAPE)


def _gather_table_axis(node):
    """An embedding lookup (Gather on a table's leading axes) splits along the table's last axis,
    which is also the output's last axis; gathering along the last axis itself cannot split so."""
    table = node.inputs[0]
    rank = len(table.shape) if table is not None and table.shape is not None else 0
    axis = node.attrs.get("axis", 0)
    return -1 if rank >= 2 and (axis % rank) != rank - 1 else None


register("Gather", kind=LAYOUT, weight_input=0, weight_axis=_gather_table_axis,
         output_axis=_gather_table_axis, keeps_bound=True)


# -- lowerings to loop nests: index arithmetic, no maths ---------------------------------------

import numpy as np  # noqa: E402

from ir.loops.builder import broadcast_load  # noqa: E402
from ir.loops.expr import all_of, binary, cast, ge, in_range, lt, maximum, minimum, select  # noqa: E402
from ir.ops.registry import lowering  # noqa: E402


@lowering("loops", *view_ops())
def _view(b, node):
    """The output is a new view of the input's storage."""
    b.alias(node.outputs[0], b.input(node, 0))


def _wrapped(index, dim):
    """An i32 index read from data, with ONNX's negative-from-the-end convention applied."""
    i = cast(index, "i32")
    return select(lt(i, 0), i + dim, i)


@lowering("loops", "Transpose")
def _transpose(b, node):
    x, y = b.input(node, 0), b.output(node)
    perm = node.attrs.get("perm") or list(reversed(range(len(x.shape))))
    with b.loops(y.shape) as idx:
        src = [0] * len(perm)
        for out_axis, in_axis in enumerate(perm):
            src[in_axis] = idx[out_axis]
        b.store(y, idx, x[tuple(src)])


@lowering("loops", "Concat")
def _concat(b, node):
    y = b.output(node)
    axis = int(node.attrs["axis"]) % len(y.shape)
    start = 0
    for v in node.present_inputs:
        x = b.buffer(v)
        if x.shape[axis] == 0:
            continue
        with b.loops(x.shape) as idx:
            at = list(idx)
            at[axis] = at[axis] + start
            b.store(y, at, x[tuple(idx)])
        start += x.shape[axis]


@lowering("loops", "Split")
def _split(b, node):
    x = b.input(node, 0)
    axis = int(node.attrs.get("axis", 0)) % len(x.shape)
    start = 0
    for i in range(len(node.outputs)):
        y = b.output(node, i)
        with b.loops(y.shape) as idx:
            at = list(idx)
            at[axis] = at[axis] + start
            b.store(y, idx, x[tuple(at)])
        start += y.shape[axis]


@lowering("loops", "Slice")
def _slice(b, node):
    x, y = b.input(node, 0), b.output(node)
    rank = len(x.shape)
    if "starts" in node.attrs:      # opset < 10
        starts, ends = node.attrs["starts"], node.attrs["ends"]
        axes, steps = node.attrs.get("axes", list(range(len(starts)))), [1] * len(starts)
    else:
        starts, ends = b.const_input(node, 1).tolist(), b.const_input(node, 2).tolist()
        axes = b.const_input(node, 3)
        axes = axes.tolist() if axes is not None else list(range(len(starts)))
        steps = b.const_input(node, 4)
        steps = steps.tolist() if steps is not None else [1] * len(starts)
    first, step = [0] * rank, [1] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = int(a) % rank
        first[a], _, step[a] = slice(int(s), int(e), int(st)).indices(x.shape[a])
    with b.loops(y.shape) as idx:
        b.store(y, idx, x[tuple(f + i * st for f, i, st in zip(first, idx, step))])


@lowering("loops", "Gather")
def _gather(b, node):
    x, ind, y = b.input(node, 0), b.input(node, 1), b.output(node)
    axis = int(node.attrs.get("axis", 0)) % len(x.shape)
    q = len(ind.shape)
    with b.loops(y.shape) as idx:
        picked = _wrapped(ind[tuple(idx[axis:axis + q])] if q else ind.at(0), x.shape[axis])
        b.store(y, idx, x[tuple(idx[:axis]) + (picked,) + tuple(idx[axis + q:])])


@lowering("loops", "GatherElements")
def _gather_elements(b, node):
    x, ind, y = b.input(node, 0), b.input(node, 1), b.output(node)
    axis = int(node.attrs.get("axis", 0)) % len(x.shape)
    with b.loops(y.shape) as idx:
        at = list(idx)
        at[axis] = _wrapped(ind[tuple(idx)], x.shape[axis])
        b.store(y, idx, x[tuple(at)])


@lowering("loops", "GatherND")
def _gather_nd(b, node):
    x, ind, y = b.input(node, 0), b.input(node, 1), b.output(node)
    batch = int(node.attrs.get("batch_dims", 0))
    depth = ind.shape[-1]
    lead = len(ind.shape) - 1
    with b.loops(y.shape) as idx:
        picked = [_wrapped(ind[tuple(idx[:lead]) + (k,)], x.shape[batch + k]) for k in range(depth)]
        b.store(y, idx, x[tuple(idx[:batch]) + tuple(picked) + tuple(idx[lead:])])


@lowering("loops", "ScatterElements", "Scatter")
def _scatter_elements(b, node):
    x, ind, upd, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    axis = int(node.attrs.get("axis", 0)) % len(x.shape)
    reduction = node.attrs.get("reduction", "none")
    b.copy(y, x)
    with b.loops(upd.shape) as idx:
        at = list(idx)
        at[axis] = _wrapped(ind[tuple(idx)], x.shape[axis])
        b.store(y, at, _combine(reduction, y[tuple(at)], upd[tuple(idx)]))


@lowering("loops", "ScatterND")
def _scatter_nd(b, node):
    x, ind, upd, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    reduction = node.attrs.get("reduction", "none")
    depth = ind.shape[-1]
    lead = len(ind.shape) - 1
    b.copy(y, x)
    with b.loops(upd.shape) as idx:
        picked = [_wrapped(ind[tuple(idx[:lead]) + (k,)], x.shape[k]) for k in range(depth)]
        at = tuple(picked) + tuple(idx[lead:])
        b.store(y, at, _combine(reduction, y[at], upd[tuple(idx)]))


@lowering("loops", "TensorScatter")
def _tensor_scatter(b, node):
    """A KV-cache write: the cache, with each batch entry's update rows placed along `axis` from
    that entry's write index (run time; default 0) on, wrapping around in circular mode. A row a
    linear write would place past the end is dropped rather than written out of bounds."""
    cache, update, write_indices, y = *(b.input(node, i) for i in range(3)), b.output(node)
    axis = int(node.attrs.get("axis", -2)) % len(cache.shape)
    circular = node.attrs.get("mode", "linear") == "circular"
    length = cache.shape[axis]
    b.copy(y, cache)
    with b.loops(update.shape) as idx:
        start = cast(write_indices.at(idx[0]), "i32") if write_indices is not None else 0
        row = start + idx[axis]
        at = list(idx)
        at[axis] = row % length if circular else row
        with b.when(in_range(at[axis], length)):
            b.store(y, at, update[tuple(idx)])


def _combine(reduction, old, new):
    return {"none": lambda: new, "add": lambda: old + new, "mul": lambda: old * new,
            "max": lambda: maximum(old, new), "min": lambda: minimum(old, new)}[reduction]()


@lowering("loops", "Expand")
def _expand(b, node):
    x, y = b.input(node, 0), b.output(node)
    with b.loops(y.shape) as idx:
        b.store(y, idx, broadcast_load(x, y.shape, idx))


@lowering("loops", "Tile")
def _tile(b, node):
    x, y = b.input(node, 0), b.output(node)
    with b.loops(y.shape) as idx:
        b.store(y, idx, x[tuple(i % d if d > 1 else 0 for i, d in zip(idx, x.shape))])


@lowering("loops", "Pad")
def _pad(b, node):
    x, y = b.input(node, 0), b.output(node)
    rank = len(x.shape)
    mode = node.attrs.get("mode", "constant")
    if "pads" in node.attrs:        # opset < 11
        pads, value = list(node.attrs["pads"]), float(node.attrs.get("value", 0.0))
        axes = list(range(rank))
    else:
        pads = b.const_input(node, 1).tolist()
        given = node.inputs[2] if len(node.inputs) > 2 else None
        if given is not None and not given.is_const:
            value = b.input(node, 2).at(0)      # computed at run time
        else:
            cv = b.const_input(node, 2)
            value = cv.reshape(-1)[0].item() if cv is not None and cv.size else 0
        ax = b.const_input(node, 3)
        axes = [int(a) % rank for a in ax.tolist()] if ax is not None else list(range(rank))
    begin = [0] * rank
    for k, a in enumerate(axes):
        begin[a] = int(pads[k])
    with b.loops(y.shape) as idx:
        src = [i - p for i, p in zip(idx, begin)]
        if mode == "constant":
            inside = all_of(in_range(s, d) for s, d in zip(src, x.shape))
            clamped = [minimum(maximum(s, 0), d - 1) for s, d in zip(src, x.shape)]
            b.store(y, idx, select(inside, x[tuple(clamped)], value) if rank else x.at(0))
        elif mode == "wrap":
            b.store(y, idx, x[tuple((s + d * (1 + p // d)) % d for s, d, p in zip(src, x.shape, begin))])
        elif mode == "edge":
            b.store(y, idx, x[tuple(minimum(maximum(s, 0), d - 1) for s, d in zip(src, x.shape))])
        else:   # reflect: mirror without repeating the edge
            def reflect(s, d):
                if d == 1:
                    return 0
                s = select(lt(s, 0), -s, s)
                return select(ge(s, d), 2 * (d - 1) - s, s)
            b.store(y, idx, x[tuple(reflect(s, d) for s, d in zip(src, x.shape))])


@lowering("loops", "DepthToSpace", "SpaceToDepth")
def _depth_space(b, node):
    x, y = b.input(node, 0), b.output(node)
    bs = int(node.attrs["blocksize"])
    crd = node.attrs.get("mode", "DCR") == "CRD"
    if node.op_type == "DepthToSpace":
        n, c, h, w = y.shape
        with b.loops(y.shape) as (i, ch, hh, ww):
            bh, bw = hh % bs, ww % bs
            src_c = (ch * bs * bs + bh * bs + bw) if crd else ((bh * bs + bw) * c + ch)
            b.store(y, (i, ch, hh, ww), x[i, src_c, _div(hh, bs), _div(ww, bs)])
    else:
        n, c, h, w = x.shape
        with b.loops(x.shape) as (i, ch, hh, ww):
            bh, bw = hh % bs, ww % bs
            dst_c = (ch * bs * bs + bh * bs + bw) if crd else ((bh * bs + bw) * c + ch)
            b.store(y, (i, dst_c, _div(hh, bs), _div(ww, bs)), x[i, ch, hh, ww])


def _div(a, d):
    return binary("div", a, d)


@lowering("loops", "ConstantOfShape")
def _constant_of_shape(b, node):
    value = node.attrs.get("value")
    b.fill(b.output(node), np.asarray(value).reshape(-1)[0].item() if value is not None else 0)


@lowering("loops", "Shape", "Size")
def _shape_query(b, node):
    shape = node.inputs[0].shape
    if node.op_type == "Size":
        values = [int(np.prod(shape, dtype=np.int64))]
    else:
        values = list(shape)[node.attrs.get("start", 0):node.attrs.get("end", len(shape))]
    y = b.output(node)
    for k, v in enumerate(values):
        b.store_flat(y, k, v)


@lowering("loops", "ReverseSequence")
def _reverse_sequence(b, node):
    x, lengths, y = b.input(node, 0), b.input(node, 1), b.output(node)
    batch_axis, time_axis = int(node.attrs.get("batch_axis", 1)), int(node.attrs.get("time_axis", 0))
    with b.loops(y.shape) as idx:
        n = cast(lengths[(idx[batch_axis],)], "i32")
        t = idx[time_axis]
        src = list(idx)
        src[time_axis] = select(lt(t, n), n - 1 - t, t)
        b.store(y, idx, x[tuple(src)])
