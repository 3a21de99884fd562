"""Chains of small CUs, for what the runtime costs per CU: x -> (MatMul, Relu) x length, each pair
one CU when `decompose` keeps one weight per CU.

The weights are He-scaled: rows shrink only slowly along the chain (a norm of about 1e-6 after 1024
pairs), so distinct inputs stay distinct to its end and no CU of a request on fresh inputs can be a
cache hit by accident.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def matmul_relu_chain(length: int, width: int, rows: int = 1, lead_relu: bool = False, seed: int = 0,
                      name: str | None = None) -> onnx.ModelProto:
    """`length` MatMul + Relu pairs on a [rows, width] input `x` (output `r{length - 1}`); with
    `lead_relu`, a Relu of x first, a CU of its own."""
    rng = np.random.default_rng(seed)
    nodes, weights, previous = [], [], "x"
    if lead_relu:
        nodes, previous = [helper.make_node("Relu", ["x"], ["x_relu"])], "x_relu"
    for i in range(length):
        w = (rng.standard_normal((width, width)) * np.sqrt(2 / width)).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("MatMul", [previous, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        previous = f"r{i}"
    graph = helper.make_graph(nodes, name or f"chain{length}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [rows, width])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
