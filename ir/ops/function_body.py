"""An expansion's ONNX function body, built op by op for one node.

A body is built per node, so what varies between nodes of one op (which optional inputs are
present, the attributes' values, constants derived from them) is decided while building: an absent
input is never read, and an attribute becomes a constant or a choice of ops. A body declares opset
`OPSET`, 13; the expand-ops pass reads its ops at the model's opset, so bodies keep to ops whose
form is the same from opset 13 on (ReduceSum with axes as an input, no ReduceMax, Shape without
start/end), and at an older opset ir/ops/body_opset.py writes the changed ones in their older form
(which is why axes are best given as constants).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ir.graph import Node

OPSET = 13


class Body:
    """The nodes of one function body; `formals` names the node's inputs in order."""

    def __init__(self, node: Node, formals: tuple[str, ...]):
        self.node = node
        self.formals = formals[:len(node.inputs)]
        self.nodes: list[onnx.NodeProto] = []
        self._names = 0

    def present(self, index: int) -> bool:
        return index < len(self.node.inputs) and self.node.inputs[index] is not None

    def input(self, index: int) -> str:
        """The body's name for input `index`; '' (ONNX's absent input) when the node omits it."""
        return self.formals[index] if self.present(index) else ""

    def const_input(self, index: int) -> np.ndarray | None:
        """The value of input `index` when the model holds it as a constant."""
        value = self.node.inputs[index] if self.present(index) else None
        return value.const if value is not None and value.is_const else None

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out: str | tuple[str, ...] | None = None,
           attributes=(), **attrs) -> str | list[str]:
        """Append a node; its output name (a list when it has several), `out` if given. Trailing
        absent inputs are dropped."""
        names = list(out) if isinstance(out, tuple) else [out] if out is not None else \
            [self._fresh(op_type) for _ in range(outputs)]
        inputs = list(inputs)
        while inputs and not inputs[-1]:
            inputs.pop()
        proto = helper.make_node(op_type, inputs, names, **attrs)
        proto.attribute.extend(attributes)
        self.nodes.append(proto)
        return names if len(names) > 1 else names[0]

    def constant(self, value, dtype=np.float32) -> str:
        return self.op("Constant", value=numpy_helper.from_array(np.asarray(value, dtype)))

    def function(self, outputs: tuple[str, ...]) -> onnx.FunctionProto:
        return helper.make_function(self.node.domain, self.node.op_type, list(self.formals), list(outputs),
                                    self.nodes, [helper.make_opsetid("", OPSET)])

    def _fresh(self, hint: str) -> str:
        self._names += 1
        return f"{hint.lower()}_{self._names}"
