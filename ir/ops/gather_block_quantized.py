"""onnxruntime's GatherBlockQuantized (com.microsoft): rows of a table quantized in blocks, gathered
and dequantized. onnxruntime-genai's builder writes it for a model that ties its embedding to its
output projection (Qwen2.5, Gemma, Phi-4-mini): the token embedding reads the 4-bit codes and
scales of lm_head's MatMulNBits, so the table is stored once.

The expansion gathers before it dequantizes: the rows of packed bytes and of scales that the
indices pick (a handful of tokens), never the table, so the table stays 4-bit in the CU. A byte
becomes its two codes, low nibble first, by a Gather from a 256 x 2 constant, which needs no
integer bit operation (the opset-13 bodies have none). Then (code - zero) * scale per block, in
onnxruntime's order; the zero point is 8 (the middle code) when absent, as for packed uint8 data in
onnxruntime's kernel.

The form taken: uint8 data packing two 4-bit codes a byte, gathered along axis 0, quantized along
the last axis in whole blocks; others are refused in one line naming the node.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ir.errors import NotExpanded
from ir.ops.function_body import Body
from ir.ops.registry import OTHER, register

DOMAIN = "com.microsoft"
BITS = 4
MIDDLE_CODE = 2 ** (BITS - 1)
# byte -> its two 4-bit codes, low nibble first
NIBBLES = np.stack([np.arange(256) & 0xF, np.arange(256) >> 4], axis=1).astype(np.float32)


def _expansion(node):
    body = Body(node, ("data", "indices", "scales", "zero_points"))
    data, indices = node.inputs[0], node.inputs[1]
    attrs = node.attrs
    rank = len(data.shape) if data.shape is not None else None
    if (int(attrs.get("bits", BITS)) != BITS or data.dtype != TensorProto.UINT8 or rank is None
            or int(attrs.get("gather_axis", 0)) != 0 or int(attrs.get("quantize_axis", 1)) not in (rank - 1, -1)):
        raise NotExpanded(f"{node.describe()}: GatherBlockQuantized is supported for uint8 data packing 4-bit "
                          "codes, gathered along axis 0 and quantized along the last axis")
    if indices.shape is None or not isinstance(data.shape[-1], int):
        raise NotExpanded(f"{node.describe()}: GatherBlockQuantized needs the rank of its indices and the "
                          "table's row length")
    width, block = 2 * data.shape[-1], int(attrs.get("block_size", 128))
    if width % block:
        raise NotExpanded(f"{node.describe()}: GatherBlockQuantized rows of {width} codes are not whole "
                          f"blocks of {block}")
    blocks = width // block
    # Reshape's 0 keeps a dim: the leading dims (indices', then the table's middle ones) stay as they are
    leading = [0] * (len(indices.shape) + rank - 2)
    packed = body.op("Cast", body.op("Gather", "data", "indices", axis=0), to=TensorProto.INT32)
    codes = body.op("Reshape", body.op("Gather", body.constant(NIBBLES), packed, axis=0),
                    body.constant([*leading, blocks, block], np.int64))
    if body.present(3):
        zero_bytes = body.op("Cast", body.op("Gather", "zero_points", "indices", axis=0), to=TensorProto.INT32)
        zeros = body.op("Reshape", body.op("Gather", body.constant(NIBBLES), zero_bytes, axis=0),
                        body.constant([*leading, -1], np.int64))
        zero = body.op("Unsqueeze", body.op("Slice", zeros, body.constant([0], np.int64),
                                            body.constant([blocks], np.int64), body.constant([-1], np.int64)),
                       body.constant([-1], np.int64))
    else:
        zero = body.constant(float(MIDDLE_CODE))
    scales = body.op("Unsqueeze", body.op("Gather", "scales", "indices", axis=0), body.constant([-1], np.int64))
    # onnxruntime dequantizes in float32 and casts to the scales' type once
    float32 = node.inputs[2].dtype == TensorProto.FLOAT
    if not float32:
        scales = body.op("Cast", scales, to=TensorProto.FLOAT)
    values = body.op("Reshape", body.op("Mul", body.op("Sub", codes, zero), scales),
                     body.constant([*leading, width], np.int64), out="output" if float32 else None)
    if not float32:
        body.op("Cast", values, to=node.inputs[2].dtype, out="output")
    return body.function(("output",))


register("GatherBlockQuantized", domain=DOMAIN, kind=OTHER, expansion=_expansion)
