"""Static upper bounds for data-dependent lengths (ir/bounds.py), inside infer-shapes' loop.

ONNX infers no static shape for the output of NonZero, Compress, Unique or NonMaxSuppression (a
model may declare the shape one example input gave, which is no bound either). Their registry
entries give each output a static upper bound and a bounded axis (`OpDef.bounds`); this step sets
them after every round of ONNX inference, then carries the bound to the nodes that read such a
value: each reader's shapes come from ONNX inference of that node alone, with the bounded axis of
its inputs spelled as one symbol per length. An output dim that is exactly that symbol is bounded
along it; the other dims must come out static. So a Gather by selected indices, a Transpose, a
Cast or an Add keeps the bound where ONNX's own rules say the dim survives, and a Concat or a
Reshape that mixes the dynamic length with others leaves the shape unknown, which check_static
then names. Graphs without these ops are not touched.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ir.errors import CortexError
from ir.graph import Graph, Node, Value
from ir.onnx_export import export_attribute, make_tensor
from ir.ops import bounds_of

# Constants up to this size go to the one-node inference as data (a Reshape's shape, a Gather's
# index); bigger ones only by type.
_LARGEST_CONSTANT = 4096


def bound_data_dependent_shapes(graph: Graph) -> None:
    for node in graph.nodes:
        if any(not v.is_tensor for v in node.outputs):
            continue
        inputs_static = all(v.is_static for v in node.present_inputs)
        rule = bounds_of(node) if inputs_static else None
        if rule is not None:
            for out, (shape, axis) in zip(node.outputs, rule):
                out.shape = tuple(int(d) for d in shape)
                out.bound_axis = axis
                out.length_key = node.outputs[0].name if axis is not None else None
            continue
        bounded = [v for v in node.present_inputs if v.is_bounded]
        if bounded and not node.subgraphs and inputs_static:
            _propagate(graph, node, bounded)


def _propagate(graph: Graph, node: Node, bounded: list[Value]) -> None:
    symbols = {key: f"cortex_length_{i}" for i, key in enumerate(dict.fromkeys(v.length_key for v in bounded))}
    bound_of = {symbols[v.length_key]: v.shape[v.bound_axis] for v in bounded}
    key_of = {symbol: key for key, symbol in symbols.items()}
    inferred = _infer_one_node(graph, node, symbols)
    for out in node.outputs:
        dims = inferred.get(out.name)
        out.bound_axis = out.length_key = None
        if dims is None:
            continue
        dynamic = [k for k, d in enumerate(dims) if d in key_of]
        if any(not isinstance(d, int) for k, d in enumerate(dims) if k not in dynamic) or len(dynamic) > 1:
            out.shape = tuple(d if isinstance(d, int) else None for d in dims)
            continue
        if len({v.length_key for v in bounded}) > 1 and dynamic:
            names = ", ".join(repr(v.name) for v in bounded)
            raise CortexError(f"{node.describe()}: reads {names}, whose data-dependent lengths may differ")
        if dynamic:
            axis = dynamic[0]
            out.shape = tuple(bound_of[d] if k == axis else d for k, d in enumerate(dims))
            out.bound_axis, out.length_key = axis, key_of[dims[axis]]
        else:
            out.shape = tuple(dims)


def _infer_one_node(graph: Graph, node: Node, symbols: dict[str, str]) -> dict[str, tuple]:
    """Output name -> dims (ints, symbols, None) from ONNX's rule for `node` alone."""
    inputs, initializers, seen = [], [], set()
    for v in node.present_inputs:
        if v.name in seen:
            continue
        seen.add(v.name)
        if v.is_const and v.const.size <= _LARGEST_CONSTANT:
            initializers.append(make_tensor(v))
            continue
        shape = list(v.shape)
        if v.is_bounded:
            shape[v.bound_axis] = symbols[v.length_key]
        inputs.append(helper.make_tensor_value_info(v.name, v.dtype, shape))
    proto = helper.make_node(node.op_type, [v.name if v is not None else "" for v in node.inputs],
                             [v.name for v in node.outputs], domain=node.domain or None)
    proto.attribute.extend(_attributes(node))
    outputs = [helper.make_value_info(v.name, onnx.TypeProto()) for v in node.outputs]
    model = helper.make_model(helper.make_graph([proto], "bound", inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in graph.opset_imports.items()])
    model.ir_version = max(graph.ir_version, 4)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # onnx raises several types; no rule means no bound
        return {}
    found = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type
        if t.HasField("tensor_type") and t.tensor_type.HasField("shape"):
            found[vi.name] = tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
                                   for d in t.tensor_type.shape.dim)
    return found


def _attributes(node: Node) -> list[onnx.AttributeProto]:
    return [export_attribute(key, value, node.attr_types.get(key), {}, False) for key, value in node.attrs.items()]
