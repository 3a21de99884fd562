"""Ops whose output length depends on their input data: NonZero, Compress, Unique and
NonMaxSuppression.

Each gives its outputs a static upper bound (`bounds=`) and marks the axis whose real extent is
known only at run time (ir/bounds.py). The lowerings write the compact result into the leading slots
of the bounded buffer, zeros after it (so a reader such as Gather by these indices stays in range),
and the real length into the value's length companion (`LoopBuilder.length`).
"""

import numpy as np

from ir.errors import UnsupportedError
from ir.loops.expr import cast, const, eq, gt, logical_and, logical_or, lt, maximum, minimum, ne, select
from ir.ops.registry import OTHER, lowering, register


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _nonzero_bounds(node):
    x = node.inputs[0]
    return [((len(x.shape), _numel(x.shape)), 1)]


def _compress_axis(node):
    """The axis Compress selects along, or None for the flattened input."""
    axis = node.attrs.get("axis")
    return None if axis is None else int(axis) % len(node.inputs[0].shape)


def _compress_bounds(node):
    x, condition = node.inputs[0], node.inputs[1]
    axis = _compress_axis(node)
    selectable = _numel(x.shape) if axis is None else x.shape[axis]
    bound = min(_numel(condition.shape), selectable)
    dynamic = 0 if axis is None else axis
    if condition.is_const:   # the length is known now: a static shape, no bound
        bound, dynamic = int(np.count_nonzero(np.asarray(condition.const).reshape(-1)[:bound])), None
    if axis is None:
        return [((bound,), dynamic)]
    return [(tuple(bound if k == axis else d for k, d in enumerate(x.shape)), dynamic)]


def _unique_axis(node):
    axis = node.attrs.get("axis")
    return None if axis is None else int(axis) % len(node.inputs[0].shape)


def _unique_bounds(node):
    x = node.inputs[0]
    axis = _unique_axis(node)
    d = _numel(x.shape) if axis is None else x.shape[axis]
    y = ((d,), 0) if axis is None else (tuple(x.shape), axis)
    return [y, ((d,), 0), ((d,), None), ((d,), 0)][:len(node.outputs)]


def _nms_per_class(node) -> int:
    """At most this many boxes per batch and class: max_output_boxes_per_class when it is a
    constant, else every box."""
    boxes = node.inputs[0].shape[1]
    given = node.inputs[2] if len(node.inputs) > 2 else None
    if given is None:
        return 0    # the op's default: no output
    if not given.is_const:
        return boxes
    return int(min(max(int(np.asarray(given.const).reshape(-1)[0]), 0), boxes))


def _nms_bounds(node):
    batches, classes = node.inputs[1].shape[0], node.inputs[1].shape[1]
    return [((batches * classes * _nms_per_class(node), 3), 0)]


register("NonZero", kind=OTHER, bounds=_nonzero_bounds, keeps_bound=True)   # padding is zeros: never selected
register("Compress", kind=OTHER, bounds=_compress_bounds)
register("Unique", kind=OTHER, bounds=_unique_bounds)
register("NonMaxSuppression", kind=OTHER, bounds=_nms_bounds)


@lowering("loops", "NonZero")
def _nonzero(b, node):
    x, y = b.input(node, 0), b.output(node)
    if not x.shape:
        raise UnsupportedError(f"{node.describe()}: NonZero of a scalar is not supported")
    numel = x.numel
    b.fill(y, 0)
    found = b.local("i32", 0, "found")
    with b.loops(x.shape) as idx:
        with b.when(ne(x[tuple(idx)], 0)):
            for d, i in enumerate(idx):
                b.store_flat(y, found + d * numel, i)
            b.assign(found, found + 1)
    b.store_flat(b.length(node.outputs[0]), 0, found)


@lowering("loops", "Compress")
def _compress(b, node):
    x, condition, y = b.input(node, 0), b.input(node, 1), b.output(node)
    axis = _compress_axis(node)
    if axis is None:
        outer, d, inner = 1, x.numel, 1
    else:
        outer, d, inner = _numel(x.shape[:axis]), x.shape[axis], _numel(x.shape[axis + 1:])
    kept_at_most = y.numel // (outer * inner) if outer * inner else 0
    considered = min(condition.numel, d)
    xv, yv = x.view((outer, d, inner)), y.view((outer, kept_at_most, inner))
    b.fill(y, 0)
    kept = b.local("i32", 0, "kept")
    with b.loop(considered, "j") as j:
        with b.when(ne(condition.at(j), 0)):
            with b.loop(outer, "o") as o, b.loop(inner, "i") as i:
                b.store(yv, (o, kept, i), xv[o, j, i])
            b.assign(kept, kept + 1)
    if node.outputs[0].is_bounded:
        b.store_flat(b.length(node.outputs[0]), 0, kept)


@lowering("loops", "Unique")
def _unique(b, node):
    """Three passes over pairs of slices (a slice is one element, or one index along `axis`):
    which slices come first among their equals and how many equal them; each first slice's rank in
    the output (by value when sorted, by first occurrence otherwise); then the outputs."""
    x = b.input(node, 0)
    axis = _unique_axis(node)
    if axis is None:
        outer, d, inner = 1, x.numel, 1
    else:
        outer, d, inner = _numel(x.shape[:axis]), x.shape[axis], _numel(x.shape[axis + 1:])
    xv = x.view((outer, d, inner))
    by_value = bool(node.attrs.get("sorted", 1))
    first, count, earliest, rank = (b.temp("int32", (d,), name) for name in ("first", "count", "earliest", "rank"))

    def order(j, i):
        """A local that ends -1, 0 or 1 as slice j is less than, equal to or greater than slice i."""
        state = b.local("i32", 0, "order")
        with b.loop(outer, "o") as o, b.loop(inner, "q") as q:
            a, c = xv[o, j, q], xv[o, i, q]
            b.assign(state, select(eq(state, 0), select(lt(a, c), -1, select(gt(a, c), const(1, "i32"), 0)), state))
        return state

    with b.loop(d, "i") as i:
        is_first, equals, at = b.local("i32", 1, "is_first"), b.local("i32", 0, "equals"), b.local("i32", d, "at")
        with b.loop(d, "j") as j:
            same = b.local("i32", eq(order(j, i), 0), "same")
            b.assign(is_first, logical_and(is_first, ne(logical_and(same, lt(j, i)), 1)))
            b.assign(equals, equals + same)
            b.assign(at, select(logical_and(same, lt(j, at)), j, at))
        b.store(first, (i,), is_first)
        b.store(count, (i,), equals)
        b.store(earliest, (i,), at)
    with b.loop(d, "i") as i:
        before = b.local("i32", 0, "before")
        with b.loop(d, "j") as j:
            earlier = eq(order(j, i), -1) if by_value else lt(j, i)
            b.assign(before, before + logical_and(ne(first[j], 0), earlier))
        b.store(rank, (i,), before)

    outputs = [b.output(node, k) if k < len(node.outputs) and node.outputs[k].dtype else None for k in range(4)]
    y, indices, inverse, counts = outputs
    for out in (y, indices, counts):
        if out is not None:
            b.fill(out, 0)
    yv = y.view((outer, d, inner)) if y is not None else None
    found = b.local("i32", 0, "found")
    with b.loop(d, "i") as i:
        with b.when(ne(first[i], 0)):
            r = rank[i]
            if yv is not None:
                with b.loop(outer, "o") as o, b.loop(inner, "q") as q:
                    b.store(yv, (o, r, q), xv[o, i, q])
            if indices is not None:
                b.store(indices, (r,), i)
            if counts is not None:
                b.store(counts, (r,), count[i])
            b.assign(found, found + 1)
        if inverse is not None:
            b.store(inverse, (i,), rank.at(earliest[i]))
    b.store_flat(b.length(node.outputs[0]), 0, found)


def _box_edges(box, center: bool):
    """(x_min, x_max, y_min, y_max) of a box, as onnxruntime computes them."""
    if center:
        half_w, half_h = box[2] / 2.0, box[3] / 2.0
        return box[0] - half_w, box[0] + half_w, box[1] - half_h, box[1] + half_h
    return minimum(box[1], box[3]), maximum(box[1], box[3]), minimum(box[0], box[2]), maximum(box[0], box[2])


def _suppresses(one, other, center: bool, threshold):
    """Whether two boxes overlap by more than `threshold` (intersection over union), with
    onnxruntime's order of operations and its checks for empty boxes."""
    x1_min, x1_max, y1_min, y1_max = _box_edges(one, center)
    x2_min, x2_max, y2_min, y2_max = _box_edges(other, center)
    ix_min, ix_max = maximum(x1_min, x2_min), minimum(x1_max, x2_max)
    iy_min, iy_max = maximum(y1_min, y2_min), minimum(y1_max, y2_max)
    intersection = (ix_max - ix_min) * (iy_max - iy_min)
    area1 = (x1_max - x1_min) * (y1_max - y1_min)
    area2 = (x2_max - x2_min) * (y2_max - y2_min)
    union = area1 + area2 - intersection
    checks = [gt(ix_max, ix_min), gt(iy_max, iy_min), gt(intersection, 0.0), gt(area1, 0.0), gt(area2, 0.0),
              gt(union, 0.0), gt(intersection / union, threshold)]
    result = checks[0]
    for c in checks[1:]:
        result = logical_and(result, c)
    return result


@lowering("loops", "NonMaxSuppression")
def _non_max_suppression(b, node):
    """Per batch and class, S rounds each visit the best-scoring box not yet visited (the lowest
    index among equal scores, onnxruntime's order) and keep it when it passes the score threshold,
    the per-class limit is not reached and no box kept before in this class overlaps it too much."""
    boxes, scores, y = b.input(node, 0), b.input(node, 1), b.output(node)
    batches, classes, count = scores.shape
    per_class = _nms_per_class(node)
    center = bool(node.attrs.get("center_point_box", 0))
    limit_input = b.input(node, 2)
    iou = b.input(node, 3)
    score_floor = b.input(node, 4)
    if boxes.shape[-1] != 4 or boxes.shape[1] != count:
        raise UnsupportedError(f"{node.describe()}: boxes {list(boxes.shape)} do not match scores {list(scores.shape)}")
    b.fill(y, 0)
    total = b.local("i32", 0, "total")
    if per_class == 0 or count == 0:
        b.store_flat(b.length(node.outputs[0]), 0, total)
        return
    if limit_input is not None and not node.inputs[2].is_const:
        limit = cast(minimum(maximum(cast(limit_input.at(0), "i64"), 0), count), "i32")
    else:
        limit = per_class
    threshold = cast(iou.at(0), "f32") if iou is not None else 0.0
    visited = b.temp("uint8", (count,), "visited")
    with b.loop(batches, "n") as n, b.loop(classes, "c") as c:
        start, kept = b.local("i32", total, "start"), b.local("i32", 0, "kept")
        b.fill(visited, 0)
        with b.loop(count, "r"):
            best = b.local(scores.compute_type, scores[n, c, 0], "best")
            where = b.local("i32", -1, "where")
            with b.loop(count, "j") as j:
                v = scores[n, c, j]
                take = b.local("i32", logical_and(eq(visited[j], 0), logical_or(lt(where, 0), gt(v, best))), "take")
                b.assign(best, select(take, v, best))
                b.assign(where, select(take, j, where))
            b.store(visited, (where,), 1)
            keep = lt(kept, limit)
            if score_floor is not None:
                keep = logical_and(keep, gt(best, cast(score_floor.at(0), scores.compute_type)))
            keep = b.local("i32", keep, "keep")
            candidate = [boxes[n, where, k] for k in range(4)]
            with b.loop(per_class, "s") as s:
                other = cast(y[start + s, 2], "i32")
                chosen = [boxes[n, other, k] for k in range(4)]
                clash = logical_and(lt(s, kept), _suppresses(candidate, chosen, center, threshold))
                b.assign(keep, logical_and(keep, ne(clash, 1)))
            with b.when(keep):
                b.store(y, (total, 0), n)
                b.store(y, (total, 1), c)
                b.store(y, (total, 2), where)
                b.assign(total, total + 1)
                b.assign(kept, kept + 1)
    b.store_flat(b.length(node.outputs[0]), 0, total)
