"""Ops ONNX defines by a function body (Attention, NegativeLogLikelihoodLoss, SwiGLU...) are lowered
by expanding that body, so each op is written once, by ONNX, rather than again here.

The node becomes a one-node model whose op is a model-local function holding the schema's body
(for context-dependent functions, the body ONNX builds for these input types); `onnx.inliner`
inlines it, and the optimisation passes bind shapes and fold what they can. `codegen.lower` hands `expand` to the builder, which lowers
the body's nodes in place of the node, reading its input buffers and writing its output buffers.
"""

from __future__ import annotations

import onnx
import onnx.inliner
from onnx import helper

from ir.errors import UnsupportedError
from ir.graph import Graph, Node
from ir.loops.builder import wanted_outputs
from ir.onnx_export import export_attribute, make_tensor
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline

_LOCAL_DOMAIN = "cortex.expanded"


def function_body(node: Node, opset: int) -> onnx.FunctionProto | None:
    """The schema's function body for `node` at the model's opset, or None."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, domain=node.domain)
    except onnx.defs.SchemaError:
        return None
    proto = _node_proto(node, schema)
    types = [_type_proto(v).SerializeToString() if v is not None else onnx.TypeProto().SerializeToString()
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
    function.domain, function.name = _LOCAL_DOMAIN, node.op_type
    call = _node_proto(node, schema)
    call.domain = _LOCAL_DOMAIN
    wanted = wanted_outputs(node)
    for j in range(len(call.output)):
        if j not in wanted:
            call.output[j] = ""
    present = [v for v in node.inputs if v is not None]
    inputs = [helper.make_value_info(v.name, _type_proto(v)) for v in present if not v.is_const]
    initializers = [make_tensor(v) for v in present if v.is_const]
    outputs = [helper.make_value_info(node.outputs[j].name, _type_proto(node.outputs[j])) for j in wanted]
    opsets = {**{o.domain: o.version for o in function.opset_import}, "": opset, _LOCAL_DOMAIN: 1}
    model = helper.make_model(helper.make_graph([call], "body", inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                              functions=[function])
    model.ir_version = max(model.ir_version, 8)
    try:
        inlined = onnx.inliner.inline_local_functions(model)
    except Exception as e:
        raise UnsupportedError(f"{node.describe()}: cannot expand its ONNX function body ({e})") from None
    kept = [o for o in inlined.opset_import if o.domain != _LOCAL_DOMAIN]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    del inlined.functions[:]
    graph = import_model(inlined)
    graph, _ = run_pipeline(graph, optimize_pipeline(require_static=True))
    return graph


def _node_proto(node: Node, schema) -> onnx.NodeProto:
    proto = helper.make_node(node.op_type, [v.name if v is not None else "" for v in node.inputs],
                             [v.name for v in node.outputs], name=node.name, domain=node.domain)
    for key, value in node.attrs.items():
        proto.attribute.append(export_attribute(key, value, node.attr_types.get(key), {}, False))
    given = {a.name for a in proto.attribute}
    for name, attr in schema.attributes.items():      # the body may refer to defaults
        if name not in given and attr.default_value.name:
            proto.attribute.append(attr.default_value)
    return proto


def _type_proto(v) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(v.dtype, list(v.shape) if v.shape is not None else None)
