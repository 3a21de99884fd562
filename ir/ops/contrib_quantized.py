"""onnxruntime's quantized matrix products (domain com.microsoft), each registered with a function
body over standard ops that the expand-ops pass inlines (see passes/expand_ops.py):
DynamicQuantizeMatMul and MatMulIntegerToFloat (what `quantize_dynamic` and onnxruntime's graph
fusions write), DynamicQuantizeLSTM, QGemm (the QOperator format), and MatMulNBits (the weight-only
2- to 8-bit block quantization of `onnxruntime.quantization.matmul_nbits_quantizer`, which int4
language models ship in).

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


def _matmul_nbits(node):
    """Y = A @ dequantized(B)^T + bias, B dequantized at compile time to A's float type: onnxruntime's
    CPU kernel at its default accuracy level also multiplies float A by dequantized blocks, so the
    results agree up to float rounding. The weight then takes 32 (or 16) bits per element in the CU
    instead of `bits`."""
    body = Body(node, ("A", "B", "scales", "zero_points", "g_idx", "bias"))
    constant = {i: body.const_input(i) for i in range(1, 5) if body.present(i)}
    if any(value is None for value in constant.values()):
        raise NotExpanded(f"{node.describe()}: MatMulNBits with a weight, scale or zero point computed at "
                          "run time is not supported")
    if constant.get(4) is not None and constant.get(3) is not None and constant[3].dtype == np.uint8:
        # onnxruntime's kernel reads no packed zero point once g_idx is given (it uses the middle code).
        raise NotExpanded(f"{node.describe()}: MatMulNBits with g_idx and packed uint8 zero points is not "
                          "supported (onnxruntime ignores those zero points); give float zero points")
    weight = nbits_weight(node, constant[1], constant[2], constant.get(3), constant.get(4))
    y = body.op("MatMul", "A", body.constant(weight.T, weight.dtype), out=None if body.present(5) else "Y")
    if body.present(5):
        body.op("Add", y, "bias", out="Y")
    return body.function(("Y",))


def nbits_weight(node, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                 g_idx: np.ndarray | None) -> np.ndarray:
    """MatMulNBits' B as [N, K] floats: (code - zero point) * scale, per block of `block_size` along
    K (or per `g_idx[k]`). Codes and packed zero points are little-endian bit fields (low bits
    first); each row's zero points start on a byte; without zero points the middle code is zero."""
    k, n = int(node.attrs["K"]), int(node.attrs["N"])
    bits, block = int(node.attrs.get("bits", 4)), int(node.attrs["block_size"])
    blocks = -(-k // block)
    if not 2 <= bits <= 8 or packed.dtype != np.uint8 or packed.size != n * blocks * block * bits // 8:
        raise UnsupportedError(f"{node.describe()}: MatMulNBits B of shape {list(packed.shape)} ({packed.dtype}) "
                               f"does not hold N={n} x {blocks} blocks of {block} {bits}-bit codes")
    codes = _bit_fields(packed.reshape(n, -1), bits)[:, :k].astype(np.float32)
    scales = scales.reshape(n, blocks).astype(np.float32)
    if zero_points is None:
        zeros = np.full((n, blocks), 2 ** (bits - 1), np.float32)
    elif zero_points.dtype == np.uint8:
        zeros = _bit_fields(zero_points.reshape(n, -1), bits)[:, :blocks].astype(np.float32)
    else:
        zeros = zero_points.reshape(n, blocks).astype(np.float32)
    group = g_idx.astype(np.int64).reshape(k) if g_idx is not None else np.arange(k) // block
    return ((codes - zeros[:, group]) * scales[:, group]).astype(node.inputs[2].const.dtype)


def _bit_fields(rows: np.ndarray, bits: int) -> np.ndarray:
    """The `bits`-wide unsigned fields of each row of bytes, low bits first."""
    flat = np.unpackbits(rows, axis=1, bitorder="little")
    fields = flat[:, :flat.shape[1] // bits * bits].reshape(rows.shape[0], -1, bits).astype(np.int32)
    return (fields << np.arange(bits, dtype=np.int32)).sum(axis=2)


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


register("DynamicQuantizeMatMul", domain=DOMAIN, kind=OTHER, expansion=_dynamic_quantize_matmul)
register("QuantizeLinear", domain=DOMAIN, kind=OTHER, expansion=_standard("QuantizeLinear"))
register("DequantizeLinear", domain=DOMAIN, kind=OTHER, expansion=_standard("DequantizeLinear"))
register("MatMulIntegerToFloat", domain=DOMAIN, kind=OTHER, expansion=_matmul_integer_to_float)
register("QGemm", domain=DOMAIN, kind=OTHER, expansion=_qgemm)
register("DynamicQuantizeLSTM", domain=DOMAIN, kind=OTHER, expansion=_dynamic_quantize_lstm)
register("MatMulNBits", domain=DOMAIN, kind=OTHER, expansion=_matmul_nbits)
