"""onnxruntime's quantized matrix products (domain com.microsoft), each registered with a function
body over standard ops that the expand-ops pass inlines (see passes/expand_ops.py):
DynamicQuantizeMatMul and MatMulIntegerToFloat (what `quantize_dynamic` and onnxruntime's graph
fusions write), DynamicQuantizeLSTM and QGemm (the QOperator format); MatMulNBits, which stays a
narrow contraction, is ir/ops/matmul_nbits.py.

The bodies follow onnxruntime's CPU kernels (onnxruntime/contrib_ops/cpu/quantization/): where a
kernel multiplies 8-bit integers into int32 sums, the body does too (MatMulInteger,
QLinearMatMul), and the float epilogue multiplies by the scales in the kernel's order, so that
results match onnxruntime's bit for bit up to the rounding of the last float multiply-add. The ops
the bodies use keep their form in every opset from 13 on, which is what the quantizer writes.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ir.errors import NotExpanded, UnsupportedError
from ir.function_call import node_proto
from ir.ops.function_body import Body
from ir.ops.registry import OTHER, register

DOMAIN = "com.microsoft"


def _scaled_integer_product(body: Body, a: str, b: str, a_scale: str, b_scale: str, a_zero: str, b_zero: str,
                            bias: str) -> None:
    """Y = float(int32 A.B) * (a_scale * b_scale) [+ bias]: the kernels' scale-bias output processor."""
    product = body.op("MatMulInteger", a, b, a_zero, b_zero)
    multiplier = body.op("Mul", a_scale, b_scale)
    scaled = body.op("Mul", body.op("Cast", product, to=TensorProto.FLOAT), multiplier,
                     out=None if bias else "Y")
    if bias:
        body.op("Add", scaled, bias, out="Y")


def _dynamic_quantize_matmul(node):
    body = Body(node, ("A", "B", "b_scale", "b_zero_point", "bias"))
    # uint8 with the range widened to hold 0, as onnxruntime's GetQuantizationParameter computes it.
    quantized, scale, zero = body.op("DynamicQuantizeLinear", "A", outputs=3)
    _scaled_integer_product(body, quantized, "B", scale, "b_scale", zero, body.input(3), body.input(4))
    return body.function(("Y",))


def _matmul_integer_to_float(node):
    body = Body(node, ("A", "B", "a_scale", "b_scale", "a_zero_point", "b_zero_point", "bias"))
    _scaled_integer_product(body, "A", "B", "a_scale", "b_scale", body.input(4), body.input(5), body.input(6))
    return body.function(("Y",))


def _qgemm(node):
    """int32 sums of the zero-point-shifted operands plus C; then either requantised to y's 8 bits
    with alpha * a_scale * b_scale / y_scale, or (no y_scale) that product without y_scale as float."""
    body = Body(node, ("A", "a_scale", "a_zero_point", "B", "b_scale", "b_zero_point", "C", "y_scale",
                       "y_zero_point"))
    a = body.op("Transpose", "A", perm=[1, 0]) if node.attrs.get("transA", 0) else "A"
    b = body.op("Transpose", "B", perm=[1, 0]) if node.attrs.get("transB", 0) else "B"
    alpha = float(node.attrs.get("alpha", 1.0))
    requantized = body.present(7)
    if requantized and alpha == 1.0 and not body.present(6) and all(body.present(i) for i in (2, 5, 8)):
        # No bias to add before requantising: exactly QLinearMatMul, whose kernels the targets offer.
        body.op("QLinearMatMul", a, "a_scale", "a_zero_point", b, "b_scale", "b_zero_point", "y_scale",
                "y_zero_point", out="Y")
        return body.function(("Y",))
    total = body.op("MatMulInteger", a, b, body.input(2), body.input(5))
    if body.present(6):
        total = body.op("Add", total, "C")
    scale = "a_scale" if alpha == 1.0 else body.op("Mul", body.constant(alpha), "a_scale")
    scale = body.op("Mul", scale, "b_scale")
    if requantized:
        scale = body.op("Div", scale, "y_scale")
    scaled = body.op("Mul", body.op("Cast", total, to=TensorProto.FLOAT), scale, out=None if requantized else "Y")
    if requantized:
        # A unit scale: the kernel's requantisation is a round to nearest even, + zero point, saturated.
        body.op("QuantizeLinear", scaled, body.constant(1.0), body.input(8), out="Y")
    return body.function(("Y",))


def _dynamic_quantize_lstm(node):
    """An LSTM over X quantized to uint8 and back, with the weights dequantized and transposed to
    ONNX's [directions, 4*hidden, size]: onnxruntime's kernel quantizes the whole sequence X once
    (GetQuantizationParameter's range widened to hold 0, as DynamicQuantizeLinear) for its input
    GEMM, so X_t W^T is the kernel's integer product times x_scale * w_scale up to float rounding.
    Without that step a wide-ranged X (one loud frame) moves the outputs far past cosine 0.9999.
    The kernel also quantizes each step's hidden state for the recurrent GEMM; that state is in
    (-1, 1), and its uint8 steps leave the outputs within about 1e-5 of cosine 1, which the float
    recurrence keeps (see tests/test_dynamic_quantize_lstm.py).

    Zero points: onnxruntime reads one per direction (the first of a per-channel row; it requires
    an int8 row to be all zero and a uint8 row to be constant), which is what `dequantized` applies."""
    body = Body(node, ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P", "W_scale",
                       "W_zero_point", "R_scale", "R_zero_point"))
    per_direction = body.constant([0, 1, -1], "int64")     # [D] or [D, 4*hidden] -> broadcast over W

    def dequantized(weight: str, scale: str, zero: str) -> str:
        centred = body.op("Sub", body.op("Cast", weight, to=TensorProto.FLOAT),
                          body.op("Reshape", body.op("Cast", zero, to=TensorProto.FLOAT), per_direction))
        return body.op("Transpose", body.op("Mul", centred, body.op("Reshape", scale, per_direction)), perm=[0, 2, 1])
    weights = dequantized("W", "W_scale", "W_zero_point")
    recurrence = dequantized("R", "R_scale", "R_zero_point")
    codes, x_scale, x_zero = body.op("DynamicQuantizeLinear", "X", outputs=3)
    x = body.op("DequantizeLinear", codes, x_scale, x_zero)
    body.op("LSTM", x, weights, recurrence, *(body.input(i) for i in range(3, 8)), out=("Y", "Y_h", "Y_c"),
            attributes=node_proto(node).attribute)
    return body.function(("Y", "Y_h", "Y_c"))


def _standard(op: str):
    """com.microsoft's QuantizeLinear and DequantizeLinear (the quantizer's `UseQDQContribOps`, and
    its 16-bit QDQ below opset 21) compute what the standard ops compute, 16-bit types included:
    the body is the standard op, which fold-qdq then sees like any other."""
    def expansion(node):
        body = Body(node, ("x", "scale", "zero_point"))
        attrs = {"axis": int(node.attrs["axis"])} if "axis" in node.attrs else {}
        body.op(op, "x", "scale", body.input(2), out="y", **attrs)
        return body.function(("y",))
    return expansion


register("DynamicQuantizeMatMul", domain=DOMAIN, kind=OTHER, expansion=_dynamic_quantize_matmul,
         quantizes_activations=lambda node: True)
register("QuantizeLinear", domain=DOMAIN, kind=OTHER, expansion=_standard("QuantizeLinear"))
register("DequantizeLinear", domain=DOMAIN, kind=OTHER, expansion=_standard("DequantizeLinear"))
register("MatMulIntegerToFloat", domain=DOMAIN, kind=OTHER, expansion=_matmul_integer_to_float)
register("QGemm", domain=DOMAIN, kind=OTHER, expansion=_qgemm)
register("DynamicQuantizeLSTM", domain=DOMAIN, kind=OTHER, expansion=_dynamic_quantize_lstm,
         quantizes_activations=lambda node: True)
