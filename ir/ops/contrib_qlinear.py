"""onnxruntime's QOperator-format ops on 8-bit tensors (domain com.microsoft), each registered with
a function body over standard ops that the expand-ops pass inlines (see passes/expand_ops.py).

The bodies compute what onnxruntime's CPU kernels compute (onnxruntime/contrib_ops/cpu/quantization/
and the MLAS routines they call), in the same number domain:
- QLinearSigmoid, QLinearLeakyRelu, and requantising an input of QLinearConcat / QLinearWhere to the
  output's scale: onnxruntime builds a 256-entry table (dequantize each possible byte, apply the
  function, quantize) and looks each element up. So does the body: the table is a few ops over a
  constant of the 256 bytes, which constant folding turns into a constant (with onnxruntime's own
  Sigmoid) when the scales are constants, then one Gather.
- QLinearGlobalAveragePool: an int32 sum of the zero-point-shifted bytes, requantised with
  x_scale / (y_scale * pixels).
- QLinearSoftmax: onnxruntime's table of exp((x - max + shift) * x_scale), its sum, and its
  requantisation with floor(1 / y_scale), saturated at the type's top, and zeros for a row whose
  sum is 0 or NaN, which the kernel leaves unwritten.
- QLinearAdd: MLAS's float form, the inputs times the ratios of the scales plus a fixed part holding
  the zero points (the spec's dequantize-add-quantize rounds differently on many halves);
  QLinearMul: the int32 product of the centred inputs, times a_scale * b_scale / c_scale.
- QLinearAveragePool: dequantized, averaged in float and quantized, as onnxruntime does (its sums
  run in another order, so a value on a half may round the other way: one quantum).
The ops the bodies use keep their form in every opset from 13 on.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ir import dtypes
from ir.errors import ModelError, UnsupportedError
from ir.function_call import node_proto
from ir.ops.function_body import Body
from ir.ops.registry import OTHER, register

DOMAIN = "com.microsoft"
QUANTIZE_ARGS = ("X", "X_scale", "X_zero_point", "Y_scale", "Y_zero_point")
BINARY_ARGS = ("A", "A_scale", "A_zero_point", "B", "B_scale", "B_zero_point", "C_scale", "C_zero_point")
FLT_MAX = float(np.finfo(np.float32).max)
BIG = np.iinfo(np.int64).max


def _required(node, name: str):
    if name not in node.attrs:
        raise ModelError(f"{node.describe()}: the attribute {name!r} is required")
    return node.attrs[name]


def _byte_type(body: Body, *indices: int) -> np.dtype | None:
    """int8 or uint8: the element type of the first of these inputs whose type the model states."""
    for i in indices:
        if body.present(i) and body.node.inputs[i].dtype != dtypes.UNDEFINED:
            return dtypes.to_numpy(body.node.inputs[i].dtype)
    return None


def _zero_point(body: Body, index: int, byte_type: np.dtype | None) -> str:
    """An absent zero point is a 0 of the op's byte type (QuantizeLinear alone would make uint8)."""
    if body.present(index) or byte_type is None or byte_type == np.uint8:
        return body.input(index)
    return body.constant(0, byte_type)


def _table_lookup(body: Body, x: str, x_quant: tuple[str, str], y_quant: tuple[str, str], byte_type,
                  function=None, out: str | None = None) -> str:
    """y = quantize(function(dequantize(x))) for 8-bit x, as onnxruntime's lookup-table kernels
    compute it: the table holds the result for each of the 256 bytes, in byte order (an int8 -1 is
    byte 255, which is where Gather's negative indices count from)."""
    def mapped(values: str, result: str | None) -> str:
        real = body.op("DequantizeLinear", values, *x_quant)
        return body.op("QuantizeLinear", function(real) if function else real, *y_quant, out=result)
    if byte_type is None:        # elementwise, the same arithmetic per element
        return mapped(x, out)
    table = mapped(body.constant(np.arange(256, dtype=np.uint8).view(byte_type), byte_type), None)
    return body.op("Gather", table, body.op("Cast", x, to=TensorProto.INT32), axis=0, out=out)


def _lookup_op(function):
    def expansion(node):
        body = Body(node, QUANTIZE_ARGS)
        byte_type = _byte_type(body, 0, 2, 4)
        _table_lookup(body, "X", ("X_scale", body.input(2)), ("Y_scale", _zero_point(body, 4, byte_type)),
                      byte_type, lambda real: function(body, node, real), out="Y")
        return body.function(("Y",))
    return expansion


def _sigmoid(body, node, real):
    return body.op("Sigmoid", real)


def _leaky_relu(body, node, real):
    return body.op("LeakyRelu", real, alpha=float(node.attrs.get("alpha", 0.01)))


def _saturated(body: Body, real: str, byte_type, zero_index: int, out: str) -> str:
    """round-to-nearest-even(real), saturated to the output's 8 bits: QuantizeLinear with a unit
    scale and a zero point of 0 of the output's type."""
    if byte_type is not None:
        zero = body.constant(0, byte_type)
    else:
        zero = body.op("Sub", body.input(zero_index), body.input(zero_index)) if body.present(zero_index) else ""
    return body.op("QuantizeLinear", real, body.constant(1.0), zero, out=out)


def _as_float(body: Body, index: int) -> str:
    return body.op("Cast", body.input(index), to=TensorProto.FLOAT)


def _add(node):
    """MLAS's QLinearAdd: y = round(fixed + a * (a_scale / c_scale) + b * (b_scale / c_scale)) with
    the zero points folded into fixed, a one-element operand folded in too, in the order of its
    AVX2 kernel (whose fused multiply-adds are a multiply and an add here)."""
    body = Body(node, BINARY_ARGS)
    byte_type = _byte_type(body, 0, 3, 2, 5, 7)
    ratio_a = body.op("Div", "A_scale", "C_scale")
    ratio_b = body.op("Div", "B_scale", "C_scale")
    shifts = [body.op("Mul", ratio, _as_float(body, zero)) for ratio, zero in ((ratio_a, 2), (ratio_b, 5))
              if body.present(zero)]
    fixed = _as_float(body, 7) if body.present(7) else body.constant(0.0)
    if shifts:
        fixed = body.op("Sub", fixed, shifts[0] if len(shifts) == 1 else body.op("Add", *shifts))

    def term(index: int, ratio: str) -> str:
        return body.op("Mul", _as_float(body, index), ratio)
    one_element = [i for i in (0, 3) if body.const_input(i) is not None and body.const_input(i).size == 1]
    first, second = ((3, ratio_b), (0, ratio_a)) if 0 not in one_element else ((0, ratio_a), (3, ratio_b))
    if one_element:     # the kernel adds the one-element operand into the fixed part first
        fixed = body.op("Add", fixed, term(*first))
        real = body.op("Add", term(*second), fixed)
    else:
        real = body.op("Add", term(0, ratio_a), body.op("Add", term(3, ratio_b), fixed))
    _saturated(body, real, byte_type, 7, "Y")
    return body.function(("Y",))


def _mul(node):
    """MLAS's QLinearMul: the int32 product of the zero-point-shifted operands, times
    a_scale * b_scale / c_scale, plus the output zero point, rounded and saturated."""
    body = Body(node, BINARY_ARGS)
    byte_type = _byte_type(body, 0, 3, 2, 5, 7)

    def centred(index: int, zero: int) -> str:
        value = body.op("Cast", body.input(index), to=TensorProto.INT32)
        return body.op("Sub", value, body.op("Cast", body.input(zero), to=TensorProto.INT32)) \
            if body.present(zero) else value
    product = body.op("Cast", body.op("Mul", centred(0, 2), centred(3, 5)), to=TensorProto.FLOAT)
    ratio = body.op("Div", body.op("Mul", "A_scale", "B_scale"), "C_scale")
    real = body.op("Mul", product, ratio)
    if body.present(7):
        real = body.op("Add", real, _as_float(body, 7))
    _saturated(body, real, byte_type, 7, "Y")
    return body.function(("Y",))


def _same_quantization(body: Body, first: tuple[int, int], second: tuple[int, int]) -> bool:
    """Both (scale, zero point) pairs are constants of equal values: requantising is a copy."""
    values = [body.const_input(i) for i in (*first, *second)]
    if any(v is None for v in values):
        return False
    return bool(np.array_equal(values[0], values[2]) and values[1].dtype == values[3].dtype
                and np.array_equal(values[1], values[3]))


def _concat(node):
    count = (len(node.inputs) - 2) // 3
    body = Body(node, ("Y_scale", "Y_zero_point", *(f"{name}{i}" for i in range(count)
                                                    for name in ("X", "X_scale", "X_zero_point"))))
    byte_type = _byte_type(body, 1, *range(2, len(node.inputs)))
    parts = []
    for i in range(count):
        x = 2 + 3 * i
        if _same_quantization(body, (x + 1, x + 2), (0, 1)):
            parts.append(body.input(x))
        else:
            parts.append(_table_lookup(body, body.input(x), (body.input(x + 1), body.input(x + 2)),
                                       ("Y_scale", body.input(1)), byte_type))
    body.op("Concat", *parts, axis=int(_required(node, "axis")), out="Y")
    return body.function(("Y",))


def _where(node):
    body = Body(node, ("condition", "X", "x_scale", "x_zero_point", "Y", "y_scale", "y_zero_point", "z_scale",
                       "z_zero_point"))
    byte_type = _byte_type(body, 1, 4, 3, 6, 8)
    z = ("z_scale", "z_zero_point")
    x = "X" if _same_quantization(body, (2, 3), (7, 8)) else \
        _table_lookup(body, "X", ("x_scale", "x_zero_point"), z, byte_type)
    y = "Y" if _same_quantization(body, (5, 6), (7, 8)) else \
        _table_lookup(body, "Y", ("y_scale", "y_zero_point"), z, byte_type)
    body.op("Where", "condition", x, y, out="Z")
    return body.function(("Z",))


def _shape_slice(body: Body, shape: str, start: int, end: int) -> str:
    return body.op("Slice", shape, body.constant([start], "int64"), body.constant([end], "int64"))


def _global_average_pool(node):
    """Sums over the pixels in int32, then the requantisation of MLAS's global average pool. The
    rank of X is not known before shape inference, so the pixels are flattened to one axis."""
    body = Body(node, QUANTIZE_ARGS)
    byte_type = _byte_type(body, 0, 2, 4)
    shape = body.op("Shape", "X")
    channels_last = bool(node.attrs.get("channels_last", 0))
    lead = _shape_slice(body, shape, 0, 1 if channels_last else 2)
    pixels = _shape_slice(body, shape, 1, -1) if channels_last else _shape_slice(body, shape, 2, BIG)
    channels = _shape_slice(body, shape, -1, BIG) if channels_last else None
    flat_shape = body.op("Concat", lead, body.constant([-1], "int64"), *([channels] if channels else []), axis=0)
    ones = body.op("Add", body.op("Mul", pixels, body.constant(0, "int64")), body.constant(1, "int64"))
    pooled_shape = body.op("Concat", lead, ones, *([channels] if channels else []), axis=0)
    values = body.op("Cast", "X", to=TensorProto.INT32)
    if body.present(2):
        values = body.op("Sub", values, body.op("Cast", "X_zero_point", to=TensorProto.INT32))
    total = body.op("ReduceSum", body.op("Reshape", values, flat_shape), body.constant([1 if channels_last else 2],
                                                                                       "int64"), keepdims=1)
    count = body.op("Cast", body.op("ReduceProd", pixels, keepdims=0), to=TensorProto.FLOAT)
    scale = body.op("Div", "X_scale", body.op("Mul", "Y_scale", count))
    scaled = body.op("Mul", body.op("Cast", total, to=TensorProto.FLOAT), scale)
    pooled = body.op("QuantizeLinear", scaled, body.constant(1.0), _zero_point(body, 4, byte_type))
    body.op("Reshape", pooled, pooled_shape, out="Y")
    return body.function(("Y",))


def _average_pool(node):
    """Dequantized, averaged in float and quantized, as onnxruntime's QLinearAveragePool does."""
    body = Body(node, QUANTIZE_ARGS)
    byte_type = _byte_type(body, 0, 2, 4)
    attributes = [a for a in node_proto(node).attribute if a.name != "channels_last"]
    channels_last = bool(node.attrs.get("channels_last", 0))
    rank = len(_required(node, "kernel_shape")) + 2
    real = body.op("DequantizeLinear", "X", "X_scale", body.input(2))
    if channels_last:
        real = body.op("Transpose", real, perm=[0, rank - 1, *range(1, rank - 1)])
    pooled = body.op("AveragePool", real, attributes=attributes)
    if channels_last:
        pooled = body.op("Transpose", pooled, perm=[0, *range(2, rank), 1])
    body.op("QuantizeLinear", pooled, "Y_scale", _zero_point(body, 4, byte_type), out="Y")
    return body.function(("Y",))


def _softmax(node):
    """onnxruntime's QLinearSoftmax: e = float(exp((x - max + shift) * x_scale)) from a 256-entry
    table (the shift keeps the sum of a row below FLT_MAX), y = round(e * floor(1 / y_scale) / sum)
    + zero point, saturated at 127 (int8) or 255 (uint8); 0 where the row's sum is 0 or NaN."""
    body = Body(node, QUANTIZE_ARGS)
    byte_type = _byte_type(body, 0, 2, 4)
    if byte_type is None:
        raise UnsupportedError(f"{node.describe()}: the element type of X (int8 or uint8) is not stated "
                               "in the model")
    signed = byte_type == np.int8
    opset = int(_required(node, "opset"))
    axis = int(node.attrs.get("axis", 1 if opset < 13 else -1))
    x = body.op("Flatten", "X", axis=axis) if opset < 13 else "X"
    axis = 1 if opset < 13 else axis
    row = body.op("Cast", body.op("Gather", body.op("Shape", x), body.constant(axis, "int64")), to=TensorProto.FLOAT)

    def double(name: str) -> str:
        return body.op("Cast", name, to=TensorProto.DOUBLE)
    x_scale = double("X_scale")
    shift = body.op("Div", body.op("Max", body.op("Sub", body.op("Log", double(body.op("Div", body.constant(FLT_MAX), row))),
                                                  body.constant(5.0, "float64")), body.constant(0.0, "float64")),
                    x_scale)
    exponents = body.op("Mul", body.op("Add", body.constant(np.arange(-255, 1), "float64"), shift), x_scale)
    table = body.op("Cast", body.op("Exp", exponents), to=TensorProto.FLOAT)
    values = body.op("Cast", x, to=TensorProto.INT32)
    row_max = body.op("TopK", values, body.constant([1], "int64"), axis=axis, outputs=2)[0]
    index = body.op("Add", body.op("Sub", values, row_max), body.constant(255, "int32"))
    e = body.op("Gather", table, index, axis=0)
    total = body.op("ReduceSum", e, body.constant([axis], "int64"), keepdims=1)
    multiplier = body.op("Floor", body.op("Div", body.constant(1.0), "Y_scale"))
    rounded = body.op("Round", body.op("Div", body.op("Mul", e, multiplier), total))
    q = body.op("Cast", rounded, to=TensorProto.INT32)
    if body.present(4):
        q = body.op("Add", q, body.op("Cast", "Y_zero_point", to=TensorProto.INT32))
    # e >= 0, so q >= the zero point: only the top saturates (onnxruntime 1.32 clamps an int8
    # result to 127; the kernel's older cast wrapped it to -128)
    q = body.op("Min", q, body.constant(127 if signed else 255, "int32"))
    q = body.op("Cast", q, to=TensorProto.INT8 if signed else TensorProto.UINT8)
    # A row whose sum is 0 or NaN (an infinite X_scale, as the quantizer computes for scores masked
    # with -inf) makes the kernel return before writing its output: onnxruntime gives zeros there.
    unwritten = body.op("Or", body.op("IsNaN", total), body.op("Equal", total, body.constant(0.0)))
    result = body.op("Where", unwritten, body.constant(0, "int8" if signed else "uint8"), q,
                     out=None if opset < 13 else "Y")
    if opset < 13:
        body.op("Reshape", result, body.op("Shape", "X"), out="Y")
    return body.function(("Y",))


register("QLinearSigmoid", domain=DOMAIN, kind=OTHER, expansion=_lookup_op(_sigmoid))
register("QLinearLeakyRelu", domain=DOMAIN, kind=OTHER, expansion=_lookup_op(_leaky_relu))
register("QLinearAdd", domain=DOMAIN, kind=OTHER, expansion=_add)
register("QLinearMul", domain=DOMAIN, kind=OTHER, expansion=_mul)
register("QLinearConcat", domain=DOMAIN, kind=OTHER, expansion=_concat)
register("QLinearWhere", domain=DOMAIN, kind=OTHER, expansion=_where)
register("QLinearGlobalAveragePool", domain=DOMAIN, kind=OTHER, expansion=_global_average_pool)
register("QLinearAveragePool", domain=DOMAIN, kind=OTHER, expansion=_average_pool)
register("QLinearSoftmax", domain=DOMAIN, kind=OTHER, expansion=_softmax)
