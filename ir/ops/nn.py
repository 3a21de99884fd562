"""Contractions and neural-network ops: the ops that own weights."""

from ir.ops.registry import CONTRACTION, NORMALIZATION, OTHER, register


def _gemm_weight_axis(node):
    return 0 if node.attrs.get("transB", 0) else 1


register("MatMul", kind=CONTRACTION, weight_input=1,
         weight_axis=lambda node: -1, output_axis=lambda node: -1)
register("Gemm", kind=CONTRACTION, weight_input=1,
         weight_axis=_gemm_weight_axis, output_axis=lambda node: 1)
register("Conv", kind=CONTRACTION, weight_input=1,
         weight_axis=lambda node: 0, output_axis=lambda node: 1)
register("ConvTranspose", "ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul",
         "DeformConv", "Einsum", kind=CONTRACTION)

register("BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
         "LpNormalization", "MeanVarianceNormalization", "LRN", "RMSNormalization",
         "Softmax", "LogSoftmax", "Hardmax", kind=NORMALIZATION)

register("MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool", "LpPool", "GlobalLpPool",
         "MaxRoiPool", "RoiAlign", "MaxUnpool", "Resize", "Upsample", "GridSample", "AffineGrid",
         "Col2Im", "CumSum", "TopK", "NonMaxSuppression", "LSTM", "GRU", "RNN", "Attention",
         "RotaryEmbedding", "DFT", "STFT", "MelWeightMatrix", "BlackmanWindow", "HannWindow",
         "HammingWindow", "DynamicQuantizeLinear", "CenterCropPad", "ImageDecoder",
         "StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer",
         "Det", "Unique", "NonZero", "Compress", "Trilu", "EyeLike", "OneHot", "Range",
         kind=OTHER)


# -- lowerings to loop nests ---------------------------------------------------------------------

import numpy as np  # noqa: E402

from ir.errors import UnsupportedError  # noqa: E402
from ir.loops.expr import fma, lt, maximum, select, unary  # noqa: E402
from ir.ops.registry import lowering  # noqa: E402
from ir.ops.windows import pad_buffer, pool_divisors, window_geometry  # noqa: E402


@lowering("loops", "MatMul")
def _matmul(b, node):
    if _matmul_as_gemm(b, node):
        return
    a, w, y = b.input(node, 0), b.input(node, 1), b.output(node)
    a_shape, w_shape = a.shape, w.shape
    if len(a_shape) == 1:
        a = a.view((1,) + a_shape)
    if len(w_shape) == 1:
        w = w.view(w_shape + (1,))
    batch = tuple(np.broadcast_shapes(a.shape[:-2], w.shape[:-2]))
    (m, k), n = a.shape[-2:], w.shape[-1]
    y = y.view(batch + (m, n))
    _zero_then_accumulate(b, y, batch, m, k, n,
                          lambda bt, i, kk: _batched(a, bt, len(batch))[(i, kk)],
                          lambda bt, kk, j: _batched(w, bt, len(batch))[(kk, j)])


@lowering("loops", "Gemm")
def _gemm(b, node):
    if _gemm_as_gemm(b, node):
        return
    a, w, c, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    if node.attrs.get("transA", 0):
        a = _transposed(b, node, 0)
    if node.attrs.get("transB", 0):
        w = _transposed(b, node, 1)
    (m, k), n = a.shape, w.shape[1]
    with b.loops((m, n)) as (i, j):
        init = 0.0
        if c is not None and beta != 0.0:
            from ir.loops.builder import broadcast_load
            init = broadcast_load(c, (m, n), (i, j)) * beta if beta != 1.0 else broadcast_load(c, (m, n), (i, j))
        b.store(y, (i, j), init)
    with b.loop(m, "i") as i, b.loop(k, "k") as kk, b.loop(n, "j") as j:
        lhs = a[i, kk] * alpha if alpha != 1.0 else a[i, kk]
        b.store(y, (i, j), fma(lhs, w[kk, j], y[i, j]))


# -- the target's ready-made kernels, where it has them (float32 only) --------------------------

def _f32(*values) -> bool:
    return all(v is None or v.dtype == 1 for v in values)   # TensorProto.FLOAT


def _matmul_as_gemm(b, node) -> bool:
    if not b.has_intrinsic("gemm") or not _f32(*node.inputs, node.outputs[0]):
        return False
    av, wv = node.inputs[0], node.inputs[1]
    y = b.output(node)
    if wv.is_const and len(wv.shape) == 2:
        k, n = wv.shape
        m = int(np.prod(av.shape[:-1], dtype=np.int64))
        packed = b.constant(b.intrinsics["gemm"].pack_weight(np.asarray(wv.const), False), wv.name + "_packed")
        b.call_intrinsic("gemm", {"a": b.buffer(av), "b": packed, "c": y}, m=m, n=n, k=k)
        return True
    if len(av.shape) == len(wv.shape) >= 2 and list(av.shape[:-2]) == list(wv.shape[:-2]) and not av.is_const:
        (m, k), n = av.shape[-2:], wv.shape[-1]
        batch = int(np.prod(av.shape[:-2], dtype=np.int64))
        scratch = b.temp("float32", (b.intrinsics["gemm"].packed_elements(k, n) * batch,), wv.name + "_panels")
        b.call_intrinsic("gemm", {"a": b.buffer(av), "b": b.buffer(wv), "b_scratch": scratch, "c": y},
                         m=m, n=n, k=k, batch=batch)
        return True
    return False


def _gemm_as_gemm(b, node) -> bool:
    wv, cv = node.inputs[1], node.inputs[2] if len(node.inputs) > 2 else None
    if not b.has_intrinsic("gemm") or not _f32(*node.inputs, node.outputs[0]) or not wv.is_const:
        return False
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    trans_a, trans_b = bool(node.attrs.get("transA", 0)), bool(node.attrs.get("transB", 0))
    y = b.output(node)
    m, n = y.shape
    bias = None
    if cv is not None and beta != 0.0:
        if not cv.is_const or int(np.asarray(cv.const).size) not in (1, n) or (len(cv.shape) == 2 and cv.shape[0] != 1):
            return False
        bias = b.constant((np.broadcast_to(np.asarray(cv.const, dtype=np.float64).reshape(-1), (n,)) * beta)
                          .astype(np.float32), cv.name + "_bias")
    weights = np.asarray(wv.const, dtype=np.float32) * np.float32(alpha) if alpha != 1.0 else np.asarray(wv.const)
    packed = b.constant(b.intrinsics["gemm"].pack_weight(weights, trans_b), wv.name + "_packed")
    k = wv.shape[1] if trans_b else wv.shape[0]
    b.call_intrinsic("gemm", {"a": b.input(node, 0), "b": packed, "c": y, "bias": bias}, m=m, n=n, k=k,
                     trans_a=trans_a)
    return True


def _conv_as_intrinsic(b, node) -> bool:
    wv = node.inputs[1]
    if not b.has_intrinsic("conv2d") or not _f32(*node.inputs, node.outputs[0]) or len(wv.shape) != 4:
        return False
    x, y = b.input(node, 0), b.output(node)
    geo = window_geometry(node, x.shape[2:], wv.shape[2:], y.shape[2:])
    params = dict(batch=x.shape[0], in_channels=x.shape[1], height=x.shape[2], width=x.shape[3],
                  out_channels=wv.shape[0], kernel=tuple(wv.shape[2:]), strides=tuple(geo.strides),
                  pads=(geo.pads_begin[0], geo.pads_begin[1], geo.pads_end[0], geo.pads_end[1]),
                  dilations=tuple(geo.dilations), groups=int(node.attrs.get("group", 1)))
    scratch = b.temp("float32", (b.intrinsics["conv2d"].scratch_elements(params),), x.name + "_im2col")
    b.call_intrinsic("conv2d", {"x": x, "w": b.input(node, 1), "y": y, "bias": b.input(node, 2), "scratch": scratch},
                     **params)
    return True


def _transposed(b, node, i):
    """A transposed operand: a transposed copy of a constant (so the inner loop reads contiguous
    rows), or a transposing copy at run time."""
    v = node.inputs[i]
    if v.is_const:
        return b.constant(np.ascontiguousarray(np.asarray(v.const).T), v.name + "_t")
    src = b.buffer(v)
    dst = b.temp(src.dtype, src.shape[::-1], v.name + "_t")
    with b.loops(dst.shape) as (r, c):
        b.store(dst, (r, c), src[c, r])
    return dst


def _batched(buf, batch_idx, batch_rank):
    """A 2-D view of `buf` at the broadcast batch position `batch_idx`."""
    class _Rows:
        def __getitem__(self, ij):
            lead = len(buf.shape) - 2
            own = batch_idx[batch_rank - lead:] if lead else []
            idx = [0 if d == 1 else v for d, v in zip(buf.shape[:lead], own)]
            return buf[tuple(idx) + tuple(ij)]
    return _Rows()


def _zero_then_accumulate(b, y, batch, m, k, n, lhs, rhs):
    """y[bt, i, j] = sum_k lhs(bt, i, k) * rhs(bt, k, j), with j innermost so rows stream."""
    b.fill(y, 0.0)
    with b.loops(batch, "b") as bt, b.loop(m, "i") as i, b.loop(k, "k") as kk, b.loop(n, "j") as j:
        b.store(y, (*bt, i, j), fma(lhs(bt, i, kk), rhs(bt, kk, j), y[(*bt, i, j)]))


@lowering("loops", "Conv")
def _conv(b, node):
    if _conv_as_intrinsic(b, node):
        return
    x, w, bias, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    group = int(node.attrs.get("group", 1))
    n_batch, channels, *spatial = x.shape
    out_channels, group_channels, *kernel = w.shape
    geo = window_geometry(node, spatial, kernel, y.shape[2:])
    xp = pad_buffer(b, x, geo.pads_begin, geo.padded, 0.0)
    per_group = out_channels // group
    with b.loops(y.shape) as (nn, m, *o):
        b.store(y, (nn, m, *o), bias[m] if bias is not None else 0.0)
    with b.loop(n_batch, "n") as nn, b.loop(group, "g") as g, b.loop(per_group, "m") as mg, \
            b.loop(group_channels, "c") as c, b.loops(kernel, "k") as k, b.loops(y.shape[2:], "o") as o:
        m = g * per_group + mg
        at = [oi * s + ki * d for oi, ki, s, d in zip(o, k, geo.strides, geo.dilations)]
        b.store(y, (nn, m, *o), fma(w[(m, c, *k)], xp[(nn, g * group_channels + c, *at)], y[(nn, m, *o)]))


@lowering("loops", "MaxPool", "AveragePool", "LpPool")
def _pool(b, node):
    if node.op_type == "MaxPool" and len(node.outputs) > 1:
        raise UnsupportedError(f"{node.describe()}: the Indices output of MaxPool is not supported")
    x, y = b.input(node, 0), b.output(node)
    kernel = [int(k) for k in node.attrs["kernel_shape"]]
    geo = window_geometry(node, x.shape[2:], kernel, y.shape[2:])
    is_max = node.op_type == "MaxPool"
    p = int(node.attrs.get("p", 2))
    fill = _lowest(x.dtype) if is_max else 0.0
    xp = pad_buffer(b, x, geo.pads_begin, geo.padded, fill)
    b.fill(y, fill)
    with b.loops(y.shape[:2], "n") as nc, b.loops(kernel, "k") as k, b.loops(y.shape[2:], "o") as o:
        at = [oi * s + ki * d for oi, ki, s, d in zip(o, k, geo.strides, geo.dilations)]
        v = xp[(*nc, *at)]
        if is_max:
            b.store(y, (*nc, *o), maximum(y[(*nc, *o)], v))
        elif node.op_type == "LpPool":
            b.store(y, (*nc, *o), y[(*nc, *o)] + _abs_pow(v, p))
        else:
            b.store(y, (*nc, *o), y[(*nc, *o)] + v)
    if node.op_type == "AveragePool":
        include_pad = bool(node.attrs.get("count_include_pad", 0))
        scale = b.constant(pool_divisors(geo, x.shape[2:], y.shape[2:], kernel, include_pad), "pool_scale")
        with b.loops(y.shape) as (nn, c, *o):
            b.store(y, (nn, c, *o), y[(nn, c, *o)] * scale[tuple(o)])
    elif node.op_type == "LpPool":
        with b.loops(y.shape) as idx:
            b.store(y, idx, _root(y[tuple(idx)], p))


@lowering("loops", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(b, node):
    x, y = b.input(node, 0), b.output(node)
    n, c = x.shape[:2]
    area = int(np.prod(x.shape[2:], dtype=np.int64))
    x, y = x.view((n, c, area)), y.view((n, c))
    p = int(node.attrs.get("p", 2))
    with b.loops((n, c)) as (i, j):
        if node.op_type == "GlobalMaxPool":
            acc = b.local(x.compute_type, _lowest(x.dtype))
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
    from ir.loops.expr import binary
    return binary("pow", unary("abs", v), float(p))


def _root(v, p):
    if p == 1:
        return v
    if p == 2:
        return unary("sqrt", v)
    from ir.loops.expr import binary
    return binary("pow", v, 1.0 / p)


def _lowest(dtype: str):
    if dtype.startswith("float"):
        return float("-inf")
    return int(np.iinfo(np.dtype(dtype)).min)


@lowering("loops", "BatchNormalization")
def _batch_norm(b, node):
    if node.attrs.get("training_mode", 0) or len([o for o in node.outputs if o.name]) > 1:
        raise UnsupportedError(f"{node.describe()}: training-mode BatchNormalization is not supported")
    x, y = b.input(node, 0), b.output(node)
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
    n, c = x.shape[:2]
    area = int(np.prod(x.shape[2:], dtype=np.int64))
    xv, yv = x.view((n, c, area)), y.view((n, c, area))
    with b.loop(n) as i, b.loop(c) as j, b.loop(area) as s:
        b.store(yv, (i, j, s), fma(xv[i, j, s], mul_of(j), add_of(j)))


@lowering("loops", "LRN")
def _lrn(b, node):
    x, y = b.input(node, 0), b.output(node)
    size = int(node.attrs["size"])
    alpha, beta, bias = (float(node.attrs.get(k, d)) for k, d in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    n, c = x.shape[:2]
    area = int(np.prod(x.shape[2:], dtype=np.int64))
    xv, yv = x.view((n, c, area)), y.view((n, c, area))
    sq = b.temp("float32", (n, c, area), "lrn_sum")
    b.fill(sq, 0.0)
    before = (size - 1) // 2
    with b.loop(n) as i, b.loop(c) as j, b.loop(size, "w") as k:
        src = j + k - before
        from ir.loops.expr import ge, logical_and
        with b.when(logical_and(ge(src, 0), lt(src, c))):
            with b.loop(area) as s:
                v = xv[i, src, s]
                b.store(sq, (i, j, s), fma(v, v, sq[i, j, s]))
    with b.loop(n) as i, b.loop(c) as j, b.loop(area) as s:
        from ir.loops.expr import binary
        denom = binary("pow", sq[i, j, s] * (alpha / size) + bias, -beta)
        b.store(yv, (i, j, s), xv[i, j, s] * denom)


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
                from ir.loops.expr import eq, logical_and
                hit = logical_and(eq(xv[o, k, i], top), lt(first, 0))
                b.assign(first, select(hit, k, first))
            with b.loop(d, "d") as k:
                from ir.loops.expr import cast, eq
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
    from ir.loops.builder import broadcast_load
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
