"""Pooling: a window slides over the spatial dims and reduces what it covers (max, mean, Lp)."""

import functools
import itertools
import operator

import numpy as np

from ir.loops.expr import all_of, binary, cast, gt, in_range, logical_and, maximum, minimum, select, unary
from ir.ops.reduce import extreme_value
from ir.ops.registry import OTHER, lowering, register
from ir.ops.windows import pad_buffer, pool_divisors, window_geometry

register("MaxPool", "GlobalMaxPool", kind=OTHER, quantized_exact=True)
register("AveragePool", "GlobalAveragePool", "LpPool", "GlobalLpPool", "MaxUnpool", kind=OTHER)


# Windows of up to this many taps are written out: each output is one expression over its taps,
# kept in registers and stored once (the output's innermost loop reads each tap with a fixed stride,
# which the WASM vectoriser turns into SIMD loads). Larger windows accumulate into the output tap
# by tap, one output row at a time, so the row being updated stays in cache; when output rows are
# narrower than a vector, each window reduces in a local instead, along its own rows.
UNROLLED_TAPS = 32


@lowering("loops", "MaxPool", "AveragePool", "LpPool")
def _pool(b, node):
    if node.op_type == "MaxPool" and len(node.outputs) > 1 and node.outputs[1].dtype:
        _max_pool_with_indices(b, node)
        return
    x, y = b.input(node, 0), b.output(node)
    kernel = [int(k) for k in node.attrs["kernel_shape"]]
    geo = window_geometry(node, x.shape[2:], kernel, y.shape[2:])
    is_max = node.op_type == "MaxPool"
    p = int(node.attrs.get("p", 2))
    fill = extreme_value(x.dtype, lowest=True) if is_max else 0.0
    needs_padding = any(geo.pads_begin) or list(geo.padded) != list(x.shape[2:])
    scale = None
    if node.op_type == "AveragePool":
        include_pad = bool(node.attrs.get("count_include_pad", 0))
        scale = b.constant(pool_divisors(geo, x.shape[2:], y.shape[2:], kernel, include_pad), "pool_scale")

    def tap(nc, o, k):   # from the padded copy (or `x` itself when there is no padding)
        return xp[(*nc, *[oi * s + ki * d for oi, ki, s, d in zip(o, k, geo.strides, geo.dilations)])]

    def finish(total, o):
        if scale is not None:
            return total * scale[tuple(o)]
        return _root(total, p) if node.op_type == "LpPool" else total

    taps = list(itertools.product(*(range(k) for k in kernel)))
    if len(taps) <= UNROLLED_TAPS:
        def window(nc, o, read):
            values = [read(nc, o, k) for k in taps]
            if is_max:
                best = b.local(y.compute_type, values[0], "max")
                for v in values[1:]:
                    b.assign(best, _max_step(best, v))
                b.store(y, (*nc, *o), best)
            else:
                terms = [_abs_pow(v, p) if node.op_type == "LpPool" else v for v in values]
                b.store(y, (*nc, *o), finish(functools.reduce(operator.add, terms), o))
        every_window_touches_the_input = all(
            begin <= k - 1 and (out - 1) * stride - begin < n
            for begin, k, out, stride, n in zip(geo.pads_begin, kernel, y.shape[2:], geo.strides, x.shape[2:]))
        if needs_padding and is_max and all(d == 1 for d in geo.dilations) and every_window_touches_the_input:
            _max_windows_in_place(b, x, y, geo, kernel, window)
            return
        xp = pad_buffer(b, x, geo.pads_begin, geo.padded, fill)
        with b.loops(y.shape[:2], "n") as nc, b.loops(y.shape[2:], "o") as o:
            window(nc, o, tap)
        return
    xp = pad_buffer(b, x, geo.pads_begin, geo.padded, fill)
    if y.shape[-1] < 4 <= kernel[-1]:
        # narrow outputs (a global-like window): each window reduces in a local, its rows innermost
        with b.loops(y.shape[:2], "n") as nc, b.loops(y.shape[2:], "o") as o:
            acc = b.local(y.compute_type, fill, "acc")
            with b.loops(kernel, "k") as k:
                v = tap(nc, o, k)
                b.assign(acc, maximum(acc, v) if is_max else acc + (_abs_pow(v, p) if node.op_type == "LpPool" else v))
            b.store(y, (*nc, *o), acc if is_max else finish(acc, o))
        return
    b.fill(y, fill)
    with b.loops(y.shape[:2], "n") as nc, b.loops(y.shape[2:-1], "o") as outer, b.loops(kernel, "k") as k, \
            b.loop(y.shape[-1], "o") as last:
        o = (*outer, last)
        current, v = y[(*nc, *o)], tap(nc, o, k)
        if is_max:
            b.store(y, (*nc, *o), _max_step(current, v))
        else:
            b.store(y, (*nc, *o), current + (_abs_pow(v, p) if node.op_type == "LpPool" else v))
    if not is_max:
        with b.loops(y.shape) as (nn, c, *o):
            b.store(y, (nn, c, *o), finish(y[(nn, c, *o)], o))


def _max_windows_in_place(b, x, y, geo, kernel, window) -> None:
    """MaxPool windows (unit dilations) read the padded input in place, no padded copy: an index
    outside the input clamps to the nearest position inside, which with unit dilation is another
    position of the same window, and a maximum may read a position twice. The outer spatial axes
    clamp (loop-invariant in the innermost loop); the last axis splits into the outputs whose
    windows lie inside the row (plain strided reads, which vectorise) and the few at either end.
    `window(nc, o, read)` emits one output. (For sums the outside must read as 0: a select per
    tap, which measured slower than the padded copy on 28 x 28 inputs.)"""
    spatial, rank = x.shape[2:], len(x.shape) - 2

    def reader(clamp_last):
        def read(nc, o, k):
            index = []
            for axis in range(rank):
                at = o[axis] * geo.strides[axis] + k[axis] - geo.pads_begin[axis]
                last = (y.shape[2 + axis] - 1) * geo.strides[axis] + kernel[axis] - 1 - geo.pads_begin[axis]
                inside = geo.pads_begin[axis] == 0 and last < spatial[axis]
                if (axis == rank - 1 and not clamp_last) or inside:
                    index.append(at)
                else:
                    index.append(minimum(maximum(at, 0), spatial[axis] - 1))
            return x[(*nc, *index)]
        return read

    width, s, begin = y.shape[-1], geo.strides[-1], geo.pads_begin[-1]
    low = min(width, -(-begin // s))                     # the first output whose window starts inside
    high = max(low, min(width, (spatial[-1] - kernel[-1] + begin) // s + 1))   # ... and ends inside
    with b.loops(y.shape[:2], "n") as nc, b.loops(y.shape[2:-1], "o") as outer:
        for start, stop, clamp in ((0, low, True), (low, high, False), (high, width, True)):
            if stop > start:
                with b.loop(stop - start, "o") as j:
                    window(nc, (*outer, j + start), reader(clamp))


def _max_pool_with_indices(b, node) -> None:
    """MaxPool and, per output, the flat position in the input of its window's first maximum (row
    major, or with storage_order=1 the spatial part column major), as onnxruntime scans a window:
    taps inside the input in order, a tap replacing the best only when strictly greater."""
    x, y, indices = b.input(node, 0), b.output(node, 0), b.output(node, 1)
    kernel = [int(k) for k in node.attrs["kernel_shape"]]
    spatial = list(x.shape[2:])
    geo = window_geometry(node, spatial, kernel, y.shape[2:])
    column_major = bool(node.attrs.get("storage_order", 0))
    area = int(np.prod(spatial, dtype=np.int64))
    strides = [int(np.prod(spatial[a + 1:], dtype=np.int64)) for a in range(len(spatial))]
    if column_major:
        strides = [int(np.prod(spatial[:a], dtype=np.int64)) for a in range(len(spatial))]
    channels = x.shape[1]
    with b.loops(y.shape[:2], "n") as (n, c), b.loops(y.shape[2:], "o") as o:
        best = b.local(y.compute_type, extreme_value(x.dtype, lowest=True), "max")
        where = b.local("i64", -1, "where")
        with b.loops(kernel, "k") as k:
            at = [oi * s + ki * d - pb for oi, ki, s, d, pb in zip(o, k, geo.strides, geo.dilations, geo.pads_begin)]
            inside = all_of(in_range(a, extent) for a, extent in zip(at, spatial))
            clamped = [minimum(maximum(a, 0), extent - 1) for a, extent in zip(at, spatial)]
            v = x[(n, c, *clamped)]
            take = b.local("i32", logical_and(inside, gt(v, best)), "take")
            flat = cast((n * channels + c) * area + sum(a * st for a, st in zip(clamped, strides)), "i64")
            b.assign(best, select(take, v, best))
            b.assign(where, select(take, flat, where))
        b.store(y, (n, c, *o), best)
        b.store(indices, (n, c, *o), where)


def _max_step(best, v):
    """The running maximum as one x86 maxps(best, v) computes it: `best > v ? best : v`. On numbers
    it is max; a NaN tap replaces the maximum so far and a later number replaces the NaN. ONNX leaves
    NaN in MaxPool unspecified, and onnxruntime's result depends on the order its MLAS kernel visits
    a window in (measured: neither NaN-propagating nor NaN-ignoring), so NaN windows may differ."""
    return select(gt(best, v), best, v)


@lowering("loops", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(b, node):
    x, y = b.input(node, 0), b.output(node)
    n, c = x.shape[:2]
    area = int(np.prod(x.shape[2:], dtype=np.int64))
    x, y = x.view((n, c, area)), y.view((n, c))
    p = int(node.attrs.get("p", 2))
    with b.loops((n, c)) as (i, j):
        if node.op_type == "GlobalMaxPool":
            acc = b.local(x.compute_type, extreme_value(x.dtype, lowest=True))
            with b.loop(area) as s:
                b.assign(acc, maximum(acc, x[i, j, s]))
            b.store(y, (i, j), acc)
        else:
            acc = b.local(x.compute_type, 0.0)
            with b.loop(area) as s:
                b.assign(acc, acc + (x[i, j, s] if node.op_type == "GlobalAveragePool" else _abs_pow(x[i, j, s], p)))
            b.store(y, (i, j), acc * (1.0 / area) if node.op_type == "GlobalAveragePool" else _root(acc, p))


def _abs_pow(v, p):
    if p == 1:
        return unary("abs", v)
    if p == 2:
        return v * v
    return binary("pow", unary("abs", v), float(p))


def _root(v, p):
    if p == 1:
        return v
    if p == 2:
        return unary("sqrt", v)
    return binary("pow", v, 1.0 / p)


@lowering("loops", "MaxUnpool")
def _max_unpool(b, node):
    """Zeros, with each input value put back at the flat output position its index names."""
    x, indices, y = b.input(node, 0), b.input(node, 1), b.output(node)
    kernel = [int(k) for k in node.attrs["kernel_shape"]]
    rank = len(kernel)
    strides = [int(s) for s in node.attrs.get("strides", [1] * rank)]
    pads = [int(p) for p in node.attrs.get("pads", [0] * (2 * rank))]
    # indices count positions in the unpooled shape the pooling saw; an explicit output_shape only
    # adds room after it
    natural = list(x.shape[:2]) + [(n - 1) * s - (pads[d] + pads[rank + d]) + k
                                   for d, (n, s, k) in enumerate(zip(x.shape[2:], strides, kernel))]
    b.fill(y, 0.0)
    with b.loop(x.numel) as i:
        flat = cast(indices.at(i), "i32")
        position = []
        for d in reversed(range(len(natural))):
            position.append(flat % natural[d] if d else flat)
            flat = binary("div", flat, natural[d])
        b.store(y, tuple(reversed(position)), x.at(i))
