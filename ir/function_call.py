"""A node's computation as a graph of other ops, from an ONNX function body.

Two places replace a node by a function body: the expand-ops pass (ops whose registry entry has an
`expansion`, such as onnxruntime's contrib ops) and the lowering of standard ops that ONNX defines
by a body (`codegen/function_bodies.py`). Both build the same one-node model: the node calls the
body as a model-local function, `onnx.inliner` inlines it, and the result is imported as a Graph
whose inputs are the node's present inputs and whose outputs are the node's outputs `wanted`.
"""

from __future__ import annotations

import onnx
import onnx.inliner
from onnx import helper

from ir.errors import UnsupportedError
from ir.graph import Graph, Node, Value
from ir.onnx_export import export_attribute, make_tensor
from ir.onnx_import import import_model

LOCAL_DOMAIN = "cortex.expanded"


def inline_body(node: Node, function: onnx.FunctionProto, opset_imports: dict[str, int], wanted: list[int],
                call: onnx.NodeProto | None = None, constants_inside: bool = True) -> Graph:
    """`call`: the calling NodeProto (default: `node` as one); `constants_inside`: constant inputs
    become initializers of the body (so the body's passes may fold them) rather than inputs."""
    function.domain, function.name = LOCAL_DOMAIN, node.op_type
    call = call if call is not None else node_proto(node)
    call.domain = LOCAL_DOMAIN
    for j in range(len(call.output)):
        if j not in wanted:
            call.output[j] = ""
    present = [v for v in node.inputs if v is not None]
    inputs = [helper.make_value_info(v.name, type_proto(v)) for v in present
              if not (constants_inside and v.is_const)]
    initializers = [make_tensor(v) for v in present if constants_inside and v.is_const]
    outputs = [helper.make_value_info(node.outputs[j].name, type_proto(node.outputs[j])) for j in wanted]
    opsets = {**{o.domain: o.version for o in function.opset_import}, **opset_imports, LOCAL_DOMAIN: 1}
    opsets.pop("ai.onnx", None)
    model = helper.make_model(helper.make_graph([call], "body", inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                              functions=[function])
    model.ir_version = max(model.ir_version, 8)
    try:
        inlined = onnx.inliner.inline_local_functions(model)
    except Exception as e:
        raise UnsupportedError(f"{node.describe()}: cannot expand its function body ({e})") from None
    kept = [o for o in inlined.opset_import if o.domain != LOCAL_DOMAIN]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    del inlined.functions[:]
    return import_model(inlined)


def node_proto(node: Node) -> onnx.NodeProto:
    proto = helper.make_node(node.op_type, [v.name if v is not None else "" for v in node.inputs],
                             [v.name for v in node.outputs], name=node.name, domain=node.domain)
    for key, value in node.attrs.items():
        proto.attribute.append(export_attribute(key, value, node.attr_types.get(key), {}, False))
    return proto


def type_proto(v: Value) -> onnx.TypeProto:
    if v.type_proto is not None:
        return v.type_proto
    shape = [d if isinstance(d, (int, str)) else None for d in v.shape] if v.shape is not None else None
    return helper.make_tensor_type_proto(v.dtype, shape)
