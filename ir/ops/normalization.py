"""Normalisations: statistics over some axes rescale the values (BatchNorm, LayerNorm, Softmax...)."""

import numpy as np

from ir.errors import UnsupportedError
from ir.loops.builder import broadcast_load
from ir.loops.expr import binary, cast, eq, fma, ge, logical_and, lt, maximum, minimum, ne, select, unary
from ir.ops.registry import NORMALIZATION, epilogue_of, lowering, register

register("BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
         "LpNormalization", "MeanVarianceNormalization", "LRN", "RMSNormalization",
         "Softmax", "LogSoftmax", "Hardmax", kind=NORMALIZATION)


@lowering("loops", "BatchNormalization")
def _batch_norm(b, node):
    if node.attrs.get("training_mode", 0) or len([o for o in node.outputs if o.name]) > 1:
        raise UnsupportedError(f"{node.describe()}: training-mode BatchNormalization is not supported")
    x = b.input(node, 0)
    eps = float(node.attrs.get("epsilon", 1e-5))
    if all(v is not None and v.is_const for v in node.inputs[1:5]):
        scale, bias, mean, var = (np.asarray(v.const, dtype=np.float64) for v in node.inputs[1:5])
        mul = scale / np.sqrt(var + eps)
        add = bias - mean * mul
        dtype = np.dtype(x.dtype if x.dtype != "float16" else "float32")
        mul_buf, add_buf = b.constant(mul.astype(dtype), "bn_scale"), b.constant(add.astype(dtype), "bn_shift")
        mul_of, add_of = (lambda c: mul_buf[c]), (lambda c: add_buf[c])
    else:
        gamma, beta, mean_, var_ = (b.input(node, i) for i in range(1, 5))
        mul_of = lambda c: gamma[c] / unary("sqrt", var_[c] + eps)  # noqa: E731
        add_of = lambda c: beta[c] - mean_[c] * mul_of(c)  # noqa: E731
    # a Relu that only reads the result, in its fusion group, runs in the same pass (densenet's BN -> Relu
    # before each Conv)
    relu = b.sole_reader(node.outputs[0])
    with_relu = relu is not None and b.fused(node, relu) and (epilogue := epilogue_of(relu)) is not None \
        and epilogue.activation == "relu" and relu.outputs[0].dtype == node.outputs[0].dtype
    y = b.absorb(relu) if with_relu else b.output(node)
    n, c = x.shape[:2]
    area = int(np.prod(x.shape[2:], dtype=np.int64))
    xv, yv = x.view((n, c, area)), y.view((n, c, area))
    with b.loop(n) as i, b.loop(c) as j, b.loop(area) as s:
        v = fma(xv[i, j, s], mul_of(j), add_of(j))
        b.store(yv, (i, j, s), maximum(v, 0) if with_relu else v)


@lowering("loops", "LRN")
def _lrn(b, node):
    """One pass: each output row sums the squares of its `size` neighbouring channels' rows (read from
    the cache: consecutive channels share them) and scales itself, instead of `size` passes over a
    sum buffer as large as the input. Missing neighbours at the edges add select(.., 0): the same
    fmas in the same order, so the same bits, as skipping them."""
    x, y = b.input(node, 0), b.output(node)
    size = int(node.attrs["size"])
    alpha, beta, bias = (float(node.attrs.get(k, d)) for k, d in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    n, c = x.shape[:2]
    area = int(np.prod(x.shape[2:], dtype=np.int64))
    xv, yv = x.view((n, c, area)), y.view((n, c, area))
    before = (size - 1) // 2
    with b.loop(n) as i, b.loop(c) as j:
        near = [b.local("i32", j + (k - before), "near") for k in range(size)]
        inside = [b.local("i32", logical_and(ge(src, 0), lt(src, c)), "inside") for src in near]
        row = [b.local("i32", minimum(maximum(src, 0), c - 1), "row") for src in near]
        with b.loop(area) as s:
            total = b.local(x.compute_type, 0.0, "squares")
            for ok, r in zip(inside, row):
                v = select(ne(ok, 0), xv[i, r, s], 0.0)
                b.assign(total, fma(v, v, total))
            b.store(yv, (i, j, s), xv[i, j, s] * _power(total * (alpha / size) + bias, -beta))


def _power(z, exponent: float):
    """z ** exponent, with square roots for the exponents LRN uses (AlexNet and GoogLeNet: beta 0.75):
    correctly rounded sqrt and one division instead of exp(y log z), several times cheaper as f32x4."""
    if exponent == -0.75:
        root = unary("sqrt", z)
        return 1.0 / (root * unary("sqrt", root))
    if exponent == -0.5:
        return 1.0 / unary("sqrt", z)
    if exponent == -1.0:
        return 1.0 / z
    return binary("pow", z, exponent)


@lowering("loops", "Softmax", "LogSoftmax", "Hardmax")
def _softmax(b, node):
    x, y = b.input(node, 0), b.output(node)
    rank = len(x.shape)
    opset = _opset(b)
    axis = int(node.attrs.get("axis", -1 if opset >= 13 else 1)) % max(rank, 1)
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    if opset >= 13:
        d, inner = x.shape[axis], int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    else:   # before opset 13 the input is coerced to 2-D at `axis`
        d, inner = int(np.prod(x.shape[axis:], dtype=np.int64)), 1
    xv, yv = x.view((outer, d, inner)), y.view((outer, d, inner))
    t = x.compute_type
    with b.loop(outer, "o") as o, b.loop(inner, "i") as i:
        top = b.local(t, float("-inf"), "max")
        with b.loop(d, "d") as k:
            b.assign(top, maximum(top, xv[o, k, i]))
        if node.op_type == "Hardmax":
            first = b.local("i32", -1, "first")
            with b.loop(d, "d") as k:
                hit = logical_and(eq(xv[o, k, i], top), lt(first, 0))
                b.assign(first, select(hit, k, first))
            with b.loop(d, "d") as k:
                b.store(yv, (o, k, i), cast(eq(k, first), t))
        else:
            total = b.local(t, 0.0, "sum")
            with b.loop(d, "d") as k:
                e = unary("exp", xv[o, k, i] - top)
                if node.op_type == "Softmax":
                    b.store(yv, (o, k, i), e)
                    b.assign(total, total + yv[o, k, i])
                else:
                    b.assign(total, total + e)
            if node.op_type == "Softmax":
                inv = b.local(t, 1.0 / total, "inv")
                with b.loop(d, "d") as k:
                    b.store(yv, (o, k, i), yv[o, k, i] * inv)
            else:
                log_total = b.local(t, unary("log", total), "log_total")
                with b.loop(d, "d") as k:
                    b.store(yv, (o, k, i), (xv[o, k, i] - top) - log_total)


@lowering("loops", "LayerNormalization")
def _layer_norm(b, node):
    x, scale, bias, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    rank = len(x.shape)
    axis = int(node.attrs.get("axis", -1)) % rank
    eps = float(node.attrs.get("epsilon", 1e-5))
    inner_shape = x.shape[axis:]
    outer, inner = int(np.prod(x.shape[:axis], dtype=np.int64)), int(np.prod(inner_shape, dtype=np.int64))
    xv, yv = x.view((outer, inner)), y.view((outer, inner))
    extra = [b.output(node, i).view((outer,)) if len(node.outputs) > i and node.outputs[i].name else None
             for i in (1, 2)]
    t = x.compute_type
    with b.loop(outer, "o") as o:
        mean = b.local(t, 0.0, "mean")
        with b.loop(inner, "i") as i:
            b.assign(mean, mean + xv[o, i])
        b.assign(mean, mean * (1.0 / inner))
        var = b.local(t, 0.0, "var")
        with b.loop(inner, "i") as i:
            dev = xv[o, i] - mean
            b.assign(var, var + dev * dev)
        inv = b.local(t, 1.0 / unary("sqrt", var * (1.0 / inner) + eps), "inv")
        with b.loops(inner_shape, "i") as idx:
            flat = sum((v * s for v, s in zip(idx, _row_major_strides(inner_shape))), start=0) if idx else 0
            value = (xv[o, flat] - mean) * inv * broadcast_load(scale, inner_shape, idx)
            if bias is not None:
                value = value + broadcast_load(bias, inner_shape, idx)
            b.store(yv, (o, flat), value)
        if extra[0] is not None:
            b.store(extra[0], (o,), mean)
        if extra[1] is not None:
            b.store(extra[1], (o,), inv)


@lowering("loops", "InstanceNormalization")
def _instance_norm(b, node):
    x, scale, bias, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    eps = float(node.attrs.get("epsilon", 1e-5))
    n, c = x.shape[:2]
    area = int(np.prod(x.shape[2:], dtype=np.int64))
    xv, yv = x.view((n, c, area)), y.view((n, c, area))
    t = x.compute_type
    with b.loop(n) as i, b.loop(c) as j:
        mean = b.local(t, 0.0, "mean")
        with b.loop(area) as s:
            b.assign(mean, mean + xv[i, j, s])
        b.assign(mean, mean * (1.0 / area))
        var = b.local(t, 0.0, "var")
        with b.loop(area) as s:
            dev = xv[i, j, s] - mean
            b.assign(var, var + dev * dev)
        mul = b.local(t, scale[j] / unary("sqrt", var * (1.0 / area) + eps), "mul")
        add = b.local(t, bias[j] - mean * mul, "add")
        with b.loop(area) as s:
            b.store(yv, (i, j, s), fma(xv[i, j, s], mul, add))


def _row_major_strides(shape) -> list[int]:
    return [int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(len(shape))]


def _opset(b) -> int:
    return int(b.graph.opset_imports.get("", b.graph.opset_imports.get("ai.onnx", 21)))


def _rows(x, axis: int):
    """x viewed as (outer, inner): inner covers the axes from `axis` on."""
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    return outer, int(np.prod(x.shape[axis:], dtype=np.int64))


@lowering("loops", "RMSNormalization")
def _rms_norm(b, node):
    x, scale, y = b.input(node, 0), b.input(node, 1), b.output(node)
    axis = int(node.attrs.get("axis", -1)) % len(x.shape)
    eps = float(node.attrs.get("epsilon", 1e-5))
    outer, inner = _rows(x, axis)
    inner_shape = x.shape[axis:]
    xv, yv = x.view((outer, inner)), y.view((outer, inner))
    t = x.compute_type
    with b.loop(outer, "o") as o:
        sq = b.local(t, 0.0, "sq")
        with b.loop(inner, "i") as i:
            b.assign(sq, sq + xv[o, i] * xv[o, i])
        inv = b.local(t, 1.0 / unary("sqrt", sq * (1.0 / inner) + eps), "inv")
        with b.loops(inner_shape, "i") as idx:
            flat = sum((v * s for v, s in zip(idx, _row_major_strides(inner_shape))), start=0) if idx else 0
            b.store(yv, (o, flat), xv[o, flat] * inv * broadcast_load(scale, inner_shape, idx))


@lowering("loops", "GroupNormalization")
def _group_norm(b, node):
    x, scale, bias, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    groups = int(node.attrs["num_groups"])
    eps = float(node.attrs.get("epsilon", 1e-5))
    n, c = x.shape[:2]
    per = c // groups
    area = int(np.prod(x.shape[2:], dtype=np.int64))
    xv, yv = x.view((n, groups, per, area)), y.view((n, groups, per, area))
    channel_scale = scale.numel == c        # opset 21: per channel; opset 18: per group
    t = x.compute_type
    count = per * area
    with b.loop(n) as i, b.loop(groups, "g") as g:
        mean = b.local(t, 0.0, "mean")
        with b.loop(per, "c") as ch, b.loop(area) as s:
            b.assign(mean, mean + xv[i, g, ch, s])
        b.assign(mean, mean * (1.0 / count))
        var = b.local(t, 0.0, "var")
        with b.loop(per, "c") as ch, b.loop(area) as s:
            dev = xv[i, g, ch, s] - mean
            b.assign(var, var + dev * dev)
        inv = b.local(t, 1.0 / unary("sqrt", var * (1.0 / count) + eps), "inv")
        with b.loop(per, "c") as ch:
            at = g * per + ch if channel_scale else g
            with b.loop(area) as s:
                b.store(yv, (i, g, ch, s), fma((xv[i, g, ch, s] - mean) * inv, scale.at(at), bias.at(at)))


@lowering("loops", "LpNormalization")
def _lp_norm(b, node):
    x, y = b.input(node, 0), b.output(node)
    axis = int(node.attrs.get("axis", -1)) % len(x.shape)
    p = int(node.attrs.get("p", 2))
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    d, inner = x.shape[axis], int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    xv, yv = x.view((outer, d, inner)), y.view((outer, d, inner))
    with b.loop(outer, "o") as o, b.loop(inner, "i") as i:
        acc = b.local(x.compute_type, 0.0, "norm")
        with b.loop(d, "k") as k:
            v = xv[o, k, i]
            b.assign(acc, acc + (unary("abs", v) if p == 1 else v * v))
        norm = b.local(x.compute_type, acc if p == 1 else unary("sqrt", acc), "norm")
        with b.loop(d, "k") as k:    # a zero vector stays zero (0/0 would be NaN)
            b.store(yv, (o, k, i), select(eq(norm, 0.0), 0.0, xv[o, k, i] / norm))


@lowering("loops", "MeanVarianceNormalization")
def _mean_variance_norm(b, node):
    x, y = b.input(node, 0), b.output(node)
    rank = len(x.shape)
    axes = sorted(int(a) % rank for a in node.attrs.get("axes", [0, 2, 3]))
    keep = [d for d in range(rank) if d not in axes]
    count = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    t = x.compute_type

    def at(kept, red):
        idx = [0] * rank
        for d, v in zip(keep, kept):
            idx[d] = v
        for d, v in zip(axes, red):
            idx[d] = v
        return tuple(idx)
    with b.loops([x.shape[d] for d in keep], "o") as kept:
        mean = b.local(t, 0.0, "mean")
        with b.loops([x.shape[d] for d in axes], "r") as red:
            b.assign(mean, mean + x[at(kept, red)])
        b.assign(mean, mean * (1.0 / count))
        var = b.local(t, 0.0, "var")
        with b.loops([x.shape[d] for d in axes], "r") as red:
            dev = x[at(kept, red)] - mean
            b.assign(var, var + dev * dev)
        inv = b.local(t, 1.0 / unary("sqrt", var * (1.0 / count) + 1e-9), "inv")
        with b.loops([x.shape[d] for d in axes], "r") as red:
            b.store(y, at(kept, red), (x[at(kept, red)] - mean) * inv)

