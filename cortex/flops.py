"""A rough cost model: floating-point operations per node, from static shapes only.

Contractions count a multiply and an add per weight use (2 * output elements * reduction length);
every other op counts one operation per output element. Good enough to rank CUs and find the
critical path of a schedule; not a performance prediction.
"""

from __future__ import annotations

import math

from ir.graph import Node


def node_flops(node: Node) -> int:
    outputs = sum(_numel(v.shape) for v in node.outputs)
    op = node.op_type
    if op == "MatMul" and node.inputs[0] is not None and node.inputs[0].shape:
        return 2 * outputs * _dim(node.inputs[0].shape[-1])
    if op == "Gemm" and node.inputs[0] is not None and node.inputs[0].shape:
        shape = node.inputs[0].shape
        return 2 * outputs * _dim(shape[0] if node.attrs.get("transA", 0) else shape[-1])
    if op in ("Conv", "ConvTranspose") and node.inputs[1] is not None and node.inputs[1].shape:
        # Conv weight: (M, C/group, k...): each output element reads C/group * prod(k) inputs.
        # ConvTranspose weight: (C, M/group, k...): each input element feeds M/group * prod(k) outputs.
        w = [_dim(d) for d in node.inputs[1].shape]
        if op == "Conv":
            return 2 * outputs * math.prod(w[1:])
        return 2 * _numel(node.inputs[0].shape) * math.prod(w[1:])
    return outputs


def _numel(shape) -> int:
    if shape is None:
        return 0
    return math.prod(_dim(d) for d in shape)


def _dim(d) -> int:
    return d if isinstance(d, int) else 1
