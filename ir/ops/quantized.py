"""The 8-bit integer ops: MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv and the
DynamicQuantizeLinear that feeds a dynamically quantized model's products.

A MatMulInteger or QLinearMatMul with a constant B of static shape (the weights of a quantized
model) is described to the target as an `IntegerGemmSpec` (B's zero point subtracted here, once, at
compile time), a 2-D ConvInteger or QLinearConv with a constant weight as an `IntegerConvSpec` (the
weight's zero point subtracted likewise), and runs on the target's integer kernel where it offers
one; everything else, and every target without one, runs the loop nests below."""

from dataclasses import replace

import numpy as np

from ir.loops.contraction import (ContractionOperands, ConvSpec, DequantizeSpec, IntegerConvSpec, IntegerGemmSpec,
                                  QuantizationOperands, RequantizeSpec)
from ir.loops.expr import cast, eq, maximum, minimum, select, unary
from ir.ops.elementwise import uint8_of
from ir.ops.nn import _batched, _residual
from ir.ops.registry import CONTRACTION, OTHER, lowering, register
from ir.ops.windows import pad_buffer, window_geometry

register("ConvInteger", "QLinearConv", "QLinearMatMul", kind=CONTRACTION)
register("MatMulInteger", kind=CONTRACTION, fusion_anchor=True)
register("DynamicQuantizeLinear", kind=OTHER, quantizes_activations=lambda node: True)

_FLOAT, _UINT8, _INT8, _INT32 = 1, 2, 3, 6     # TensorProto element types


def _inputs(node, count: int) -> list:
    return [node.inputs[i] if i < len(node.inputs) else None for i in range(count)]


def _scalar(value) -> bool:
    return value is None or (value.is_static and value.numel == 1)


def _per_tensor_or_column(value, n: int) -> bool:
    return value is None or (value.is_static and value.numel in (1, n) and (value.numel == 1 or value.shape[-1] == n))


def _product_shape(av, wv) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of A @ B as the integer GEMM runs it: a 2-D B (A's batch dims folded into its
    rows), or, for a B that is an activation, a B with A's own batch dims (one product per batch
    entry: attention's heads); None for other broadcasts."""
    k, n = (int(d) for d in wv.shape[-2:])
    if len(wv.shape) == 2:
        return 1, int(np.prod(av.shape[:-1], dtype=np.int64)), k, n
    if wv.is_const or len(av.shape) != len(wv.shape) or tuple(av.shape[:-2]) != tuple(wv.shape[:-2]):
        return None
    return int(np.prod(av.shape[:-2], dtype=np.int64)), int(av.shape[-2]), k, n


def _integer_matmul_as_gemm(b, node) -> bool:
    """The product as the target's integer GEMM: A of 8 bits with a per-tensor zero point, B an
    8-bit matrix, either a constant with a constant per-tensor or per-column zero point (subtracted
    here), or an activation (one matrix per product of A's batch) with a per-tensor zero point read at
    run time; for QLinearMatMul float32 scales, per tensor but B's (per column too). A MatMulInteger
    whose int32 result only a Cast to float32 and a Mul by a scale read (MatMulIntegerToFloat) runs
    with the dequantising epilogue instead (`_dequantizing_epilogue`)."""
    qlinear = node.op_type == "QLinearMatMul"
    if qlinear:
        av, a_scale, a_zero, wv, w_scale, w_zero, y_scale, y_zero = _inputs(node, 8)
    else:
        av, wv, a_zero, w_zero = _inputs(node, 4)
        a_scale = w_scale = y_scale = y_zero = None
    yv = node.outputs[0]
    if av.dtype not in (_UINT8, _INT8) or wv.dtype not in (_UINT8, _INT8) or not wv.is_static \
            or len(wv.shape) < 2 or not av.is_static or not av.shape or not yv.is_static:
        return False
    shape = _product_shape(av, wv)
    if shape is None:
        return False
    batch, m, k, n = shape
    if not _scalar(a_zero) or not (_per_tensor_or_column(w_zero, n) if wv.is_const else _scalar(w_zero)) \
            or (wv.is_const and w_zero is not None and not w_zero.is_const):
        return False
    if qlinear and (not all(v is not None and v.dtype == _FLOAT for v in (a_scale, w_scale, y_scale))
                    or not (_scalar(a_scale) and _scalar(y_scale) and _scalar(y_zero))
                    or not _per_tensor_or_column(w_scale, n) or yv.dtype not in (_UINT8, _INT8)):
        return False
    if not qlinear and yv.dtype != _INT32:
        return False
    requantize = RequantizeSpec(b_scale_per_column=w_scale.numel != 1, signed_output=yv.dtype == _INT8,
                                out_zero=y_zero is not None) if qlinear else None
    spec = IntegerGemmSpec(m, n, k, a_signed=av.dtype == _INT8, a_zero=a_zero is not None, requantize=requantize,
                           batch=batch, constant_b=wv.is_const, b_signed=wv.dtype == _INT8,
                           b_zero=w_zero is not None and not wv.is_const)
    weights = None
    if wv.is_const:
        weights = np.asarray(wv.const).astype(np.int32)
        if w_zero is not None:
            weights = weights - np.asarray(w_zero.const).astype(np.int32).reshape(-1)
        spec = replace(spec, b_column_span=int((weights.max(0) - weights.min(0)).max()), b_signed=False)
    if not b.offers(spec):
        return False
    y, spec, bias, residual, dequantize_scale = _dequantizing_epilogue(b, node, spec)
    quantization = QuantizationOperands(*(b.buffer(v) if v is not None else None
                                          for v in (a_zero, a_scale, w_scale, y_scale, y_zero)),
                                        b_zero=b.buffer(w_zero) if spec.b_zero else None,
                                        dequantize_scale=dequantize_scale)
    operands = ContractionOperands(b.buffer(av), b.contraction_weight(spec, wv, weights), y, bias=bias,
                                   residual=residual, quantization=quantization)
    b.call_contraction(spec, operands, av.name, wv.name)
    return True


def _dequantizing_epilogue(b, node, spec: IntegerGemmSpec):
    """(output buffer, spec, bias, residual, scale) of the kernel for `node`: a MatMulInteger whose
    int32 result is read only by a Cast to float32, whose result only a Mul by a float32 scale (one
    value, or one per column: onnxruntime's MatMulIntegerToFloat, what `quantize_dynamic` writes as
    Mul(Cast(MatMulInteger), a_scale * b_scale)) reads, absorbs those two, then an Add of a constant
    per-column bias, then a residual Add, all of its fusion group (`LoopBuilder.fused`). The scale may
    be computed at run time: it must then come before `node` in graph order (FuseGroups' rule for an
    operand from outside a group), so that it is ready when the kernel runs."""
    plain = b.output(node) if spec.requantize is not None or node.op_type != "MatMulInteger" else None
    if plain is not None:
        return plain, spec, None, None, None
    cast_node = b.sole_reader(node.outputs[0])
    if cast_node is None or cast_node.op_type != "Cast" or int(cast_node.attrs.get("to", 0)) != _FLOAT \
            or not b.fused(node, cast_node):
        return b.output(node), spec, None, None, None
    mul = b.sole_reader(cast_node.outputs[0])
    value = cast_node.outputs[0]
    if mul is None or mul.op_type != "Mul" or len(mul.inputs) != 2 or not b.fused(node, mul) \
            or (mul.inputs[0] is value) == (mul.inputs[1] is value):
        return b.output(node), spec, None, None, None
    scale = mul.inputs[1] if mul.inputs[0] is value else mul.inputs[0]
    if scale.dtype != _FLOAT or not scale.is_static or scale.numel not in (1, spec.n) \
            or any(d != 1 for d in scale.shape[:-1]) or (scale.numel != 1 and scale.shape[-1] != spec.n) \
            or tuple(mul.outputs[0].shape) != tuple(value.shape) or not _ready_before(b, scale, node):
        return b.output(node), spec, None, None, None
    b.absorb(cast_node)
    out, value = b.absorb(mul), mul.outputs[0]
    bias = residual = None
    reader = b.sole_reader(value)
    if reader is not None and reader.op_type == "Add" and len(reader.inputs) == 2 and b.fused(node, reader) \
            and reader.outputs[0].dtype == _FLOAT and tuple(reader.outputs[0].shape) == tuple(value.shape):
        other = reader.inputs[1] if reader.inputs[0] is value else reader.inputs[0]
        if other is not value and other.is_const and other.dtype == _FLOAT and other.numel == spec.n \
                and tuple(other.shape[-1:]) == (spec.n,):
            bias = b.constant(np.asarray(other.const, dtype=np.float32).reshape(-1), other.name + "_bias")
            out, value = b.absorb(reader), reader.outputs[0]
            reader = b.sole_reader(value)
    if (other := _residual(b, node, reader, value)) is not None:
        residual = b.buffer(other)
        out = b.absorb(reader)
    dequantize = DequantizeSpec(scale_per_column=scale.numel != 1, bias=bias is not None, residual=residual is not None)
    return out, replace(spec, dequantize=dequantize), bias, residual, b.buffer(scale)


def _ready_before(b, value, node) -> bool:
    """Whether `value` is computed before `node`'s kernel runs: a constant, a graph input, or the
    output of a node earlier in graph order (kernels run in that order)."""
    if value.is_const or value.producer is None:
        return True
    at, producer_at = b.position(node), b.position(value.producer)
    return at is not None and producer_at is not None and producer_at < at


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
    vectorise: the range as pmin/pmax partials, the quantisation with 32-bit lane stores of bytes
    (`uint8_of`)."""
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
        b.store_flat(y, i, uint8_of(unary("nearest", x.at(i) / s) + zp))


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
