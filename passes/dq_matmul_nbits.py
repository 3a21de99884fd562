"""A MatMul whose B is DequantizeLinear of constant 4- or 8-bit codes becomes one com.microsoft
MatMulNBits, so the weight stays narrow in its CU instead of folding into float32 (a rule of
fold-qdq: onnxruntime's DQMatMulToMatMulNBits, in the same QDQ transformers).

Exporters write weight-only quantized language models this way in standard ops, onnxruntime's
`MatMulNBitsQuantizer(..., quant_format=QuantFormat.QDQ)` among them: codes [K, N] (int4, uint4,
int8 or uint8), DequantizeLinear(codes, scale, zero point, axis=0, block_size=B) at opset 21, the
result MatMul's B. Its value at (k, n) is (code - zero[k // B, n]) * scale[k // B, n], which is
MatMulNBits' B transposed: one scale and zero point per (column, block of B consecutive k).
Without block_size, one scale for the whole weight or one per column (axis 1) is the same with
every block of a column holding that column's scale: the blocks are then 128 k (or K rounded up
to a power of two, if smaller), so any K works and the repeated scales cost 4 bytes per 128 codes.
That form is taken only for weight-only quantization, an A that no DequantizeLinear produces: with
a dequantized A it is a static QDQ model's MatMul, which fold-qdq's integer rules own, and one
they leave stays the float MatMul onnxruntime runs.

MatMulNBits holds unsigned codes. Signed ones (int4, int8) shift by 2^(bits-1), their zero points
too: (code - zero) is unchanged, so every dequantized value is exactly the DequantizeLinear's.
Zero points that are all the middle code after the shift (a symmetric weight) are left out, which
MatMulNBits reads as the middle code. accuracy_level 0: float32 A times B dequantized to float32,
as the MatMul computed it.

Only where MatMulNBits can hold it: a float32 A of rank >= 2, a 2-D constant B, float32 scales,
constant zero points, blocks along K that are powers of two of at least 16 (onnxruntime's kernels
take no others). Anything else stays, and the folding after fold-qdq makes a float32 constant of it.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ir import dtypes
from ir.graph import Graph, Node, Value

DOMAIN = "com.microsoft"
CODE_BITS = {TensorProto.INT4: 4, TensorProto.UINT4: 4, TensorProto.INT8: 8, TensorProto.UINT8: 8}
SIGNED = (TensorProto.INT4, TensorProto.INT8)
MIN_BLOCK = 16
WHOLE_COLUMN_BLOCK = 128    # the blocks a per-column or per-tensor scale is repeated over


def dq_matmul_to_nbits(node: Node, graph: Graph) -> tuple[Node, Node] | None:
    """(the MatMulNBits that replaces MatMul `node`, the DequantizeLinear it reads past), or None."""
    a, b = node.inputs[0], node.inputs[1]
    dq = b.producer
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain:
        return None
    if a.dtype != TensorProto.FLOAT or a.shape is None or len(a.shape) < 2:
        return None
    codes, scale, zero = (dq.inputs + [None] * 3)[:3]
    if codes.dtype not in CODE_BITS or not codes.is_const or np.ndim(codes.const) != 2:
        return None
    if not scale.is_const or scale.dtype != TensorProto.FLOAT or (zero is not None and not zero.is_const):
        return None
    k, n = codes.const.shape
    if not int(dq.attrs.get("block_size", 0)) and a.producer is not None and a.producer.op_type == "DequantizeLinear":
        return None     # a static QDQ model's MatMul (see above)
    blocking = _column_blocks(dq, k, n)
    zero_values = np.asarray(zero.const if zero is not None else np.zeros(scale.const.shape, np.int32))
    if blocking is None or zero_values.size != np.size(scale.const):
        return None
    block, per_column = blocking
    bits = CODE_BITS[codes.dtype]
    shift = 2 ** (bits - 1) if codes.dtype in SIGNED else 0
    scales = per_column(np.asarray(scale.const, np.float32))                                 # [N, blocks]
    zeros = per_column(zero_values.astype(np.int32).reshape(np.shape(scale.const)) + shift)  # [N, blocks]
    blocks = scales.shape[1]
    padded = np.zeros((n, blocks * block), np.int32)                                         # [N, K] padded
    padded[:, :k] = np.asarray(codes.const).astype(np.int32).T + shift
    inputs = [a, _constant(graph, codes.name + "_nbits", pack_fields(padded, bits).reshape(n, blocks, -1)),
              _constant(graph, scale.name + "_nbits", np.ascontiguousarray(scales.reshape(-1)))]
    if np.any(zeros != 2 ** (bits - 1)):
        inputs.append(_constant(graph, codes.name + "_nbits_zero", pack_fields(zeros, bits).reshape(-1)))
    graph.opset_imports.setdefault(DOMAIN, 1)
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": 0}
    nbits = Node("MatMulNBits", inputs, [node.outputs[0]], attrs, node.name, DOMAIN,
                 attr_types={key: 2 for key in attrs})   # 2: AttributeProto.INT
    return nbits, dq


def _column_blocks(dq: Node, k: int, n: int):
    """(block size, a function taking the DequantizeLinear's scale-shaped arrays to [N, blocks]), or
    None when MatMulNBits cannot express the DequantizeLinear's blocks."""
    scale_shape = np.shape(dq.inputs[1].const)
    block_size = int(dq.attrs.get("block_size", 0))
    if block_size:
        blocks = -(-k // block_size)
        if int(dq.attrs.get("axis", 1)) % 2 != 0 or scale_shape != (blocks, n) or not _is_block_size(block_size):
            return None
        return block_size, lambda array: np.ascontiguousarray(array.T)
    block = min(WHOLE_COLUMN_BLOCK, max(MIN_BLOCK, 1 << (k - 1).bit_length()))
    blocks = -(-k // block)
    if int(np.prod(scale_shape)) == 1:
        return block, lambda array: np.full((n, blocks), array.reshape(()), array.dtype)
    if int(dq.attrs.get("axis", 1)) % 2 == 1 and scale_shape == (n,):
        return block, lambda array: np.repeat(array.reshape(n, 1), blocks, axis=1)
    return None


def _is_block_size(block: int) -> bool:
    return block >= MIN_BLOCK and block & (block - 1) == 0


def pack_fields(values: np.ndarray, bits: int) -> np.ndarray:
    """Each row of unsigned `bits`-wide values as bytes, low bits first, a row starting on a byte:
    MatMulNBits' layout of codes and zero points (ir/ops/matmul_nbits.py reads it back)."""
    rows, count = values.shape
    fields = (values[:, :, None] >> np.arange(bits)) & 1
    flat = fields.reshape(rows, count * bits).astype(np.uint8)
    return np.packbits(flat, axis=1, bitorder="little")


def _constant(graph: Graph, base: str, array: np.ndarray) -> Value:
    return Value(graph.fresh_name(base), dtypes.from_numpy(array.dtype), tuple(array.shape), array)
