"""The 8-bit integer ops: MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv and the
DynamicQuantizeLinear that feeds a dynamically quantized model's products.

A MatMulInteger or QLinearMatMul with a constant B of static shape (the weights of a quantized
model) is described to the target as an `IntegerGemmSpec` (B's zero point subtracted here, once, at
compile time), a 2-D ConvInteger or QLinearConv with a constant weight as an `IntegerConvSpec` (the
weight's zero point subtracted likewise), and runs on the target's integer kernel where it offers
one; everything else, and every target without one, runs the loop nests below."""

import numpy as np

from ir.loops.contraction import (ContractionOperands, ConvSpec, IntegerConvSpec, IntegerGemmSpec, QuantizationOperands,
                                  RequantizeSpec)
from ir.loops.expr import cast, eq, maximum, minimum, select, unary
from ir.ops.nn import _batched
from ir.ops.registry import CONTRACTION, OTHER, lowering, register
from ir.ops.windows import pad_buffer, window_geometry

register("ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", kind=CONTRACTION)
register("DynamicQuantizeLinear", kind=OTHER)

_FLOAT, _UINT8, _INT8, _INT32 = 1, 2, 3, 6     # TensorProto element types


def _inputs(node, count: int) -> list:
    return [node.inputs[i] if i < len(node.inputs) else None for i in range(count)]


def _scalar(value) -> bool:
    return value is None or (value.is_static and value.numel == 1)


def _per_tensor_or_column(value, n: int) -> bool:
    return value is None or (value.is_static and value.numel in (1, n) and (value.numel == 1 or value.shape[-1] == n))


def _integer_matmul_as_gemm(b, node) -> bool:
    """The product as the target's integer GEMM: A of 8 bits (any batch dims, folded into rows) with
    a per-tensor zero point, B a constant 8-bit matrix with a constant per-tensor or per-column zero
    point; for QLinearMatMul float32 scales, per tensor but B's (per column too)."""
    qlinear = node.op_type == "QLinearMatMul"
    if qlinear:
        av, a_scale, a_zero, wv, w_scale, w_zero, y_scale, y_zero = _inputs(node, 8)
    else:
        av, wv, a_zero, w_zero = _inputs(node, 4)
        a_scale = w_scale = y_scale = y_zero = None
    yv = node.outputs[0]
    if av.dtype not in (_UINT8, _INT8) or wv.dtype not in (_UINT8, _INT8) or not wv.is_const \
            or len(wv.shape) != 2 or not av.is_static or not av.shape or not yv.is_static:
        return False
    k, n = (int(d) for d in wv.shape)
    if not _scalar(a_zero) or not _per_tensor_or_column(w_zero, n) or (w_zero is not None and not w_zero.is_const):
        return False
    if qlinear and (not all(v is not None and v.dtype == _FLOAT for v in (a_scale, w_scale, y_scale))
                    or not (_scalar(a_scale) and _scalar(y_scale) and _scalar(y_zero))
                    or not _per_tensor_or_column(w_scale, n) or yv.dtype not in (_UINT8, _INT8)):
        return False
    if not qlinear and yv.dtype != _INT32:
        return False
    weights = np.asarray(wv.const).astype(np.int32)
    if w_zero is not None:
        weights = weights - np.asarray(w_zero.const).astype(np.int32).reshape(-1)
    requantize = RequantizeSpec(b_scale_per_column=w_scale.numel != 1, signed_output=yv.dtype == _INT8,
                                out_zero=y_zero is not None) if qlinear else None
    spec = IntegerGemmSpec(int(np.prod(av.shape[:-1], dtype=np.int64)), n, k, a_signed=av.dtype == _INT8,
                           a_zero=a_zero is not None, b_column_span=int((weights.max(0) - weights.min(0)).max()),
                           requantize=requantize)
    if not b.offers(spec):
        return False
    quantization = QuantizationOperands(*(b.buffer(v) if v is not None else None
                                          for v in (a_zero, a_scale, w_scale, y_scale, y_zero)))
    operands = ContractionOperands(b.buffer(av), b.contraction_weight(spec, wv, weights), b.output(node),
                                   quantization=quantization)
    b.call_contraction(spec, operands, av.name, wv.name)
    return True


@lowering("loops", "MatMulInteger", "QLinearMatMul")
def _integer_matmul(b, node):
    """int32 products of zero-point-shifted 8-bit operands; QLinearMatMul then requantises."""
    if _integer_matmul_as_gemm(b, node):
        return
    qlinear = node.op_type == "QLinearMatMul"
    if qlinear:
        a, a_scale, a_zero, w, w_scale, w_zero, y_scale, y_zero = (b.input(node, i) for i in range(8))
    else:
        a, w, a_zero, w_zero = (b.input(node, i) for i in range(4))
    y = b.output(node)
    a2 = a.view((1,) + a.shape) if len(a.shape) == 1 else a
    w2 = w.view(w.shape + (1,)) if len(w.shape) == 1 else w
    batch = tuple(np.broadcast_shapes(a2.shape[:-2], w2.shape[:-2]))
    (m, k), n = a2.shape[-2:], w2.shape[-1]
    yv = y.view(batch + (m, n))

    def zero(z, axis_index):       # per tensor, or per row of A / per column of B
        if z is None:
            return 0
        return cast(z.at(0) if z.numel == 1 else z.at(axis_index), "i32")
    with b.loops(batch, "b") as bt, b.loop(m, "i") as i, b.loop(n, "j") as j:
        acc = b.local("i32", 0, "acc")
        with b.loop(k, "k") as kk:
            lhs = cast(_batched(a2, bt, len(batch))[(i, kk)], "i32") - zero(a_zero, i)
            rhs = cast(_batched(w2, bt, len(batch))[(kk, j)], "i32") - zero(w_zero, j)
            b.assign(acc, acc + lhs * rhs)
        if not qlinear:
            b.store(yv, (*bt, i, j), acc)
            return
        scale = (cast(a_scale.at(0) if a_scale.numel == 1 else a_scale.at(i), "f32")
                 * cast(w_scale.at(0) if w_scale.numel == 1 else w_scale.at(j), "f32")
                 / cast(y_scale.at(0), "f32"))
        q = unary("nearest", cast(acc, "f32") * scale) + cast(y_zero.at(0), "f32") if y_zero is not None else \
            unary("nearest", cast(acc, "f32") * scale)
        info = np.iinfo(np.dtype(y.dtype))
        b.store(yv, (*bt, i, j), cast(minimum(maximum(q, float(info.min)), float(info.max)), y.compute_type))


@lowering("loops", "DynamicQuantizeLinear")
def _dynamic_quantize(b, node):
    """uint8 quantisation with the scale and zero point taken from the data's range (which always
    includes 0), as the spec computes them; an empty range (all zeros) has scale 1, as onnxruntime's
    kernel gives it (qmath.h, GetQuantizationParameter), not 0 (whose 0 / 0 would be NaN). Both loops
    vectorise: the range as pmin/pmax partials, the quantisation with 32-bit lane stores of bytes."""
    x, y, scale, zero = b.input(node, 0), b.output(node, 0), b.output(node, 1), b.output(node, 2)
    low = b.local("f32", 0.0, "low")
    high = b.local("f32", 0.0, "high")
    with b.loop(x.numel) as i:
        b.assign(low, minimum(low, x.at(i)))
        b.assign(high, maximum(high, x.at(i)))
    s = b.local("f32", select(eq(high, low), 1.0, (high - low) / 255.0), "scale")
    zp = b.local("f32", minimum(maximum(unary("nearest", (0.0 - low) / s), 0.0), 255.0), "zero")
    b.store_flat(scale, 0, s)
    b.store_flat(zero, 0, cast(zp, "i32"))
    with b.loop(x.numel) as i:
        q = unary("nearest", x.at(i) / s) + zp
        b.store_flat(y, i, cast(minimum(maximum(q, 0.0), 255.0), "i32"))


def _integer_conv_as_kernel(b, node) -> bool:
    """The Conv as the target's integer Conv: 8-bit NCHW x with a per-tensor zero point, a constant
    8-bit weight [OC, C/g, KH, KW] with a constant per-tensor or per-output-channel zero point; for
    QLinearConv float32 scales, per tensor but the weight's (per output channel too), and an int32
    bias of OC values."""
    qlinear = node.op_type == "QLinearConv"
    if qlinear:
        xv, x_scale, x_zero, wv, w_scale, w_zero, y_scale, y_zero, bias = _inputs(node, 9)
    else:
        xv, wv, x_zero, w_zero = _inputs(node, 4)
        x_scale = w_scale = y_scale = y_zero = bias = None
    yv = node.outputs[0]
    if xv.dtype not in (_UINT8, _INT8) or wv.dtype not in (_UINT8, _INT8) or not wv.is_const \
            or len(wv.shape) != 4 or not xv.is_static or len(xv.shape) != 4 or not yv.is_static:
        return False
    out_channels = int(wv.shape[0])
    if not _scalar(x_zero) or not _per_tensor_or_column(w_zero, out_channels) \
            or (w_zero is not None and not w_zero.is_const):
        return False
    if qlinear and (not all(v is not None and v.dtype == _FLOAT for v in (x_scale, w_scale, y_scale))
                    or not (_scalar(x_scale) and _scalar(y_scale) and _scalar(y_zero))
                    or not _per_tensor_or_column(w_scale, out_channels) or yv.dtype not in (_UINT8, _INT8)
                    or (bias is not None and (bias.dtype != _INT32 or not bias.is_static or bias.numel != out_channels))):
        return False
    if not qlinear and yv.dtype != _INT32:
        return False
    (batch, channels, height, width), kernel = (int(d) for d in xv.shape), [int(d) for d in wv.shape[2:]]
    geo = window_geometry(node, (height, width), kernel, [int(d) for d in yv.shape[2:]])
    conv = ConvSpec(batch=batch, in_channels=channels, height=height, width=width, out_channels=out_channels,
                    kernel=tuple(kernel), strides=tuple(geo.strides),
                    pads=(geo.pads_begin[0], geo.pads_begin[1], geo.pads_end[0], geo.pads_end[1]),
                    dilations=tuple(geo.dilations), groups=int(node.attrs.get("group", 1)))
    weights = np.asarray(wv.const).astype(np.int32)
    if w_zero is not None:
        weights = weights - np.asarray(w_zero.const).astype(np.int32).reshape(-1, 1, 1, 1)
    requantize = RequantizeSpec(b_scale_per_column=w_scale.numel != 1, signed_output=yv.dtype == _INT8,
                                out_zero=y_zero is not None) if qlinear else None
    spec = IntegerConvSpec(conv, x_signed=xv.dtype == _INT8, x_zero=x_zero is not None, bias=bias is not None,
                           requantize=requantize)
    if not b.offers(spec):
        return False
    quantization = QuantizationOperands(*(b.buffer(v) if v is not None else None
                                          for v in (x_zero, x_scale, w_scale, y_scale, y_zero)))
    operands = ContractionOperands(b.buffer(xv), b.contraction_weight(spec, wv, weights), b.output(node),
                                   bias=b.buffer(bias) if bias is not None else None, quantization=quantization)
    b.call_contraction(spec, operands, xv.name, wv.name)
    return True


@lowering("loops", "ConvInteger", "QLinearConv")
def _integer_conv(b, node):
    """int32 sums of zero-point-shifted 8-bit products; the padding holds the input's zero point so
    it contributes nothing. QLinearConv then adds its int32 bias and requantises."""
    if _integer_conv_as_kernel(b, node):
        return
    qlinear = node.op_type == "QLinearConv"
    if qlinear:
        x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias = (b.input(node, i) for i in range(9))
    else:
        x, w, x_zero, w_zero = (b.input(node, i) for i in range(4))
    y = b.output(node)
    group = int(node.attrs.get("group", 1))
    n_batch, channels, *spatial = x.shape
    out_channels, group_channels, *kernel = w.shape
    geo = window_geometry(node, spatial, kernel, y.shape[2:])
    xp = pad_buffer(b, x, geo.pads_begin, geo.padded, x_zero.at(0) if x_zero is not None else 0)
    acc = b.temp("int32", y.shape, y.name + "_acc") if qlinear else y
    b.fill(acc, 0)
    per_group = out_channels // group

    def zero(z, m):
        return 0 if z is None else cast(z.at(0) if z.numel == 1 else z.at(m), "i32")
    with b.loop(n_batch, "n") as nn, b.loop(group, "g") as g, b.loop(per_group, "m") as mg, \
            b.loop(group_channels, "c") as c, b.loops(kernel, "k") as k, b.loops(y.shape[2:], "o") as o:
        m = g * per_group + mg
        at = [oi * s + ki * d for oi, ki, s, d in zip(o, k, geo.strides, geo.dilations)]
        product = (cast(xp[(nn, g * group_channels + c, *at)], "i32") - zero(x_zero, 0)) * \
            (cast(w[(m, c, *k)], "i32") - zero(w_zero, m))
        b.store(acc, (nn, m, *o), acc[(nn, m, *o)] + product)
    if qlinear:
        info = np.iinfo(np.dtype(y.dtype))
        with b.loops(y.shape) as (nn, m, *o):
            total = acc[(nn, m, *o)] + (cast(bias[(m,)], "i32") if bias is not None else 0)
            scale = (cast(x_scale.at(0), "f32") * cast(w_scale.at(0) if w_scale.numel == 1 else w_scale.at(m), "f32")
                     / cast(y_scale.at(0), "f32"))
            q = unary("nearest", cast(total, "f32") * scale) + (cast(y_zero.at(0), "f32") if y_zero is not None else 0.0)
            b.store(y, (nn, m, *o), cast(minimum(maximum(q, float(info.min)), float(info.max)), y.compute_type))
