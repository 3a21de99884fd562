"""Ops ONNX defines by a function body (Attention, NegativeLogLikelihoodLoss, SwiGLU...) are lowered
by expanding that body, so each op is written once, by ONNX, rather than again here.

The node becomes a one-node model whose op is a model-local function holding the schema's body
(for context-dependent functions, the body ONNX builds for these input types; `ir/function_call.py`
inlines it), and the optimisation passes bind shapes and fold what they can. `codegen.lower` hands `expand` to the builder, which lowers
the body's nodes in place of the node, reading its input buffers and writing its output buffers.
"""

from __future__ import annotations

import onnx

from ir.errors import UnsupportedError
from ir.function_call import inline_body, node_proto, type_proto
from ir.graph import Graph, Node
from ir.loops.builder import wanted_outputs
from passes import optimize_pipeline, run_pipeline


def function_body(node: Node, opset: int) -> onnx.FunctionProto | None:
    """The schema's function body for `node` at the model's opset, or None."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, domain=node.domain)
    except onnx.defs.SchemaError:
        return None
    proto = _node_proto(node, schema)
    types = [type_proto(v).SerializeToString() if v is not None else onnx.TypeProto().SerializeToString()
             for v in node.inputs]
    versions = [v for v in schema.function_opset_versions if v <= opset]
    if versions:
        text = schema.get_function_with_opset_version(max(versions))
    else:
        versions = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
        if not versions:
            return None
        try:
            text = schema.get_context_dependent_function_with_opset_version(max(versions), proto.SerializeToString(), types)
        except Exception:       # onnx refuses to build a body for these inputs
            return None
    function = onnx.FunctionProto()
    function.ParseFromString(text)
    return function


def expand(node: Node, opset_imports: dict[str, int]) -> Graph:
    """The node's function body as a static-shape graph whose inputs are the node's present inputs
    and whose outputs are its `wanted_outputs`, in order."""
    opset = opset_imports.get(node.domain, opset_imports.get("", 21))
    function = function_body(node, opset)
    if function is None:
        raise UnsupportedError(f"{node.describe()}: no loop-nest lowering and no ONNX function body")
    schema = onnx.defs.get_schema(node.op_type, opset, domain=node.domain)
    graph = inline_body(node, function, {"": opset}, wanted_outputs(node), call=_node_proto(node, schema))
    graph, _ = run_pipeline(graph, optimize_pipeline(require_static=True))
    return graph


def _node_proto(node: Node, schema) -> onnx.NodeProto:
    proto = node_proto(node)
    given = {a.name for a in proto.attribute}
    for name, attr in schema.attributes.items():      # the body may refer to defaults
        if name not in given and attr.default_value.name:
            proto.attribute.append(attr.default_value)
    return proto
