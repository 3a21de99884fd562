"""Bind the model's dynamic dims and give every value a dtype and (where possible) a static shape.

Each op's shape rule is its ONNX schema inference (see `ir.ops.registry`), run through
`onnx.shape_inference` with data propagation. Shape computations (Shape -> Gather -> Concat ->
Reshape) only become static once their inputs are constants, so inference and folding alternate
until nothing changes. ONNX has no rules for onnxruntime's contrib ops (com.microsoft): in a graph
that has some, once the inputs are bound, onnxruntime's symbolic shape inference fills in the
values ONNX left unknown (`passes.contrib_shapes`). Graphs without contrib ops never run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import helper

from ir import dtypes
from ir.errors import CortexError, ModelError
from ir.graph import Graph, Node, Value
from ir.ops import lookup
from ir.ops.spectral import STFT_DEFAULTS
from ir.onnx_export import export_attribute, make_tensor, make_value_info
from passes.base import Pass
from passes.bound_shapes import bound_data_dependent_shapes
from passes.contrib_shapes import has_contrib_nodes, infer_contrib_shapes
from passes.expand_ops import declined_because, expand_ops, waiting_expansion
from passes.fold_constants import FoldConstants
from passes.inline_constant_ifs import inline_constant_ifs
from passes.loop_bodies import bind_body_inputs, lengths_from_readers, loop_hint
from passes.static_sequences import resolve_static_sequences
from passes.unroll_loops import MAX_TRIPS, unroll_loops

# Attribute defaults that ONNX's own shape inference reads differently from the spec, onnxruntime and
# the reference evaluator (onnx 1.23: an STFT without `onesided` gets two-sided bins), made explicit
# in the model it infers.
DEFAULTS_FOR_INFERENCE = {("", "STFT"): STFT_DEFAULTS}

# Constants above this many elements are passed to ONNX inference as typed inputs, not data: no
# shape computation reads a tensor that large, and it keeps huge models under protobuf's 2 GiB.
LARGEST_CONSTANT_FOR_INFERENCE = 4096


@dataclass
class InferShapes(Pass):
    name = "infer-shapes"
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)
    require_static: bool = False
    max_rounds: int = 10
    # A Loop of at most this many iterations becomes copies of its body (passes/unroll_loops.py); 0: never.
    max_unrolled_trips: int = MAX_TRIPS
    keep_dequantized_weights: bool = False     # see FoldConstants

    def run(self, graph: Graph) -> Graph:
        bind_inputs(graph, self.input_shapes, self.dims)
        fold = FoldConstants(keep_dequantized_weights=self.keep_dequantized_weights)
        for _ in range(self.max_rounds):
            bodies_changed = bind_body_inputs(graph)
            infer_with_onnx(graph)
            bodies_changed |= apply_shape_rules(graph) | lengths_from_readers(graph)
            bodies_changed |= bind_body_inputs(graph)
            if has_contrib_nodes(graph.walk()):
                infer_with_contrib_rules(graph)
            fill_declared_zeros(graph)
            bound_data_dependent_shapes(graph)
            before = sum(1 for _ in graph.walk())
            fold.run(graph)
            inlined = inline_constant_ifs(graph)
            inlined += unroll_loops(graph, self.max_unrolled_trips) if self.max_unrolled_trips else 0
            inlined += resolve_static_sequences(graph)
            inlined += expand_ops(graph)      # the expansions that waited for shapes
            if not inlined and not bodies_changed and sum(1 for _ in graph.walk()) == before:
                break
        if self.require_static:
            waiting = waiting_expansion(graph)
            if waiting is not None:
                raise waiting
            check_static(graph)
        return graph


def apply_shape_rules(graph: Graph) -> bool:
    """The registry's own shape rules, where an op has one, fill in what ONNX's left unknown (a
    Loop's carried state and scan outputs); returns whether any value changed."""
    opset = graph.opset_imports.get("", 21)
    changed = False
    for node in graph.walk():
        entry = lookup(node.op_type, node.domain)
        if entry is None or entry.shape_rule is None:
            continue
        for out, found in zip(node.outputs, entry.shape_rule(node, opset)):
            if found is None or out.is_static or not out.is_tensor:
                continue
            dtype, shape = found
            if out.shape is None or len(out.shape) == len(shape):
                merged = shape if out.shape is None else tuple(o if isinstance(o, int) else n for o, n in zip(out.shape, shape))
                if dtype and out.dtype == dtypes.UNDEFINED:
                    out.dtype = dtype
                if merged != out.shape:
                    out.shape, changed = merged, True
    return changed


def fill_declared_zeros(graph: Graph) -> None:
    """Where inference left a dim unknown that the model declared as 0 (an output sized by an
    input's value, such as ConstantOfShape of an input), the declaration is all there is: take it."""
    for v in graph.values():
        if v.declared_zero_axes and v.shape is not None:
            v.shape = tuple(0 if i in v.declared_zero_axes and not isinstance(d, int) else d
                            for i, d in enumerate(v.shape))


def bind_inputs(graph: Graph, input_shapes: dict[str, tuple[int, ...]], dims: dict[str, int]) -> None:
    by_name = {v.name: v for v in graph.inputs}
    # The model's own symbols, before --input-shape replaces some: `--input-shape x=2x64 --dim batch=2`
    # names a real dim of the model even though x is already bound.
    symbols = {d for v in graph.inputs if v.shape for d in v.shape if isinstance(d, str)}
    for name, shape in input_shapes.items():
        if name not in by_name:
            listed = ", ".join(by_name) or "none"
            raise CortexError(f"--input-shape names {name!r}, which is not an input of the model (inputs: {listed})")
        value = by_name[name]
        if value.shape is not None and len(value.shape) != len(shape):
            raise CortexError(f"--input-shape {name}: rank {len(shape)} given, but the model declares "
                              f"rank {len(value.shape)} ({_format_shape(value.shape)})")
        if value.shape is not None:
            for declared, given in zip(value.shape, shape):
                if isinstance(declared, int) and declared != given:
                    raise CortexError(f"--input-shape {name}: {'x'.join(map(str, shape))} conflicts with "
                                      f"the declared static shape {_format_shape(value.shape)}")
        value.shape = tuple(int(d) for d in shape)
    for dim, size in dims.items():
        if dim not in symbols:
            known = ", ".join(sorted(symbols)) or "none"
            raise CortexError(f"--dim {dim!r} matches no dynamic dim of the model inputs (dynamic dims: {known})")
    for v in graph.inputs:
        if v.shape is not None:
            v.shape = tuple(dims.get(d, d) if isinstance(d, str) else d for d in v.shape)


def check_static(graph: Graph) -> None:
    """Every graph input bound, then every value static; the first miss is named."""
    for v in graph.inputs:
        if v.is_tensor and not v.is_static:
            dynamic = [d for d in (v.shape or ()) if not isinstance(d, int)]
            if v.shape is None:
                raise CortexError(f"input {v.name!r} has no declared shape: give it with --input-shape {v.name}=...")
            named = [d for d in dynamic if isinstance(d, str)]
            hint = f"--dim {named[0]}=N or " if named else ""
            raise CortexError(f"input {v.name!r} has dynamic shape {_format_shape(v.shape)}: bind it with "
                              f"{hint}--input-shape {v.name}=...")
    read = set(graph.users()) | set(graph.outputs)
    for node in graph.nodes:
        for out in node.outputs:
            if out in read and out.is_tensor and not out.is_static:
                raise CortexError(f"{node.describe()}: cannot infer a static shape for output {out.name!r} "
                                  f"(got {_format_shape(out.shape)}){_if_hint(graph, node)}{loop_hint(node)}{_bound_hint(node)}"
                                  f"{_declined_hint(node)}")


def _declined_hint(node: Node) -> str:
    """An op whose expansion declined this node's form has no shape rule of its own: say why."""
    why = declined_because(node)
    return f"; it stays unexpanded: {why}" if why else ""


def _if_hint(graph: Graph, node: Node) -> str:
    """An If whose branches differ in shape is static only once its condition is: name the model
    inputs that decide it, which --freeze-input turns into constants."""
    if node.op_type != "If" or node.domain:
        return ""
    deciding = _inputs_reaching(graph, node.inputs[0])
    if not deciding:
        return ""
    names = ", ".join(repr(v.name) for v in deciding)
    example = " ".join(f"--freeze-input {v.name}=VALUE.npy" for v in deciding)
    several = " ".join(f"--specialize {v.name}=V1,V2" for v in deciding)
    return (f"; its branches differ in shape and the branch is chosen at run time by model input {names}: "
            f"specialise the model for one value with {example}, or for several in one bundle with {several}")


def _bound_hint(node: Node) -> str:
    """A reader of a data-dependent length whose output shape would mix that length with others."""
    bounded = [v.name for v in node.present_inputs if v.is_bounded]
    if not bounded:
        return ""
    return (f"; it reads {', '.join(map(repr, bounded))}, whose length is known only at run time, and its "
            "output would not keep that length along one axis")


def _inputs_reaching(graph: Graph, value: Value) -> list[Value]:
    """The non-constant model inputs `value` is computed from, in the model's input order."""
    inputs = {id(v) for v in graph.inputs if not v.is_const}
    seen, stack, found = set(), [value], set()
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if id(v) in inputs:
            found.add(id(v))
        elif v.producer is not None:
            stack.extend(v.producer.present_inputs)
    return [v for v in graph.inputs if id(v) in found]


def _format_shape(shape) -> str:
    if shape is None:
        return "unknown rank"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def infer_with_onnx(graph: Graph) -> None:
    model = _inference_model(graph)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as e:  # onnx raises several types here; all mean the model is inconsistent
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"shape inference failed: {first_line}") from None
    found: dict[str, onnx.ValueInfoProto] = {}
    _collect_value_info(inferred.graph, found)
    for g in _graphs(graph):
        for node in g.nodes:
            for out in node.outputs:
                info = found.get(out.name)
                if info is not None:
                    _merge(out, info)


def infer_with_contrib_rules(graph: Graph) -> None:
    """Static dims from onnxruntime's symbolic inference for the values ONNX left unknown, once
    every input is bound (a symbolic result would only rename what `--dim` binds)."""
    unknown = [out for g in _graphs(graph) for node in g.nodes for out in node.outputs
               if out.is_tensor and not out.is_static]
    if not unknown or not all(v.is_static for v in graph.inputs if v.is_tensor):
        return
    inferred = infer_contrib_shapes(_inference_model(graph))
    if inferred is None:
        return
    found: dict[str, onnx.ValueInfoProto] = {}
    _collect_value_info(inferred.graph, found)
    for value in unknown:
        info = found.get(value.name)
        if info is not None and info.type.HasField("tensor_type"):
            _merge_static_dims(value, info.type.tensor_type)


def _merge_static_dims(value: Value, tt: onnx.TypeProto.Tensor) -> None:
    """Only what is certain: the dtype where none is known, and dims with a value."""
    if tt.elem_type and value.dtype == dtypes.UNDEFINED:
        value.dtype = tt.elem_type
    if not tt.HasField("shape"):
        return
    new = tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in tt.shape.dim)
    if value.shape is None:
        value.shape = new
    elif len(value.shape) == len(new):
        value.shape = tuple(o if isinstance(o, int) or n is None else n for o, n in zip(value.shape, new))


def _merge(value: Value, info: onnx.ValueInfoProto) -> None:
    t = info.type
    if not t.HasField("tensor_type"):
        if t.WhichOneof("value") and value.type_proto is None and value.dtype == dtypes.UNDEFINED:
            value.type_proto = onnx.TypeProto()
            value.type_proto.CopyFrom(t)
        return
    tt = t.tensor_type
    if tt.elem_type:
        value.dtype = tt.elem_type
    if tt.HasField("shape"):
        new = tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        if value.shape is None or len(value.shape) != len(new):
            value.shape = new
        else:  # keep what we knew where inference knows less
            value.shape = tuple(n if isinstance(n, int) or not isinstance(o, int) else o
                                for o, n in zip(value.shape, new))


def _collect_value_info(gp: onnx.GraphProto, found: dict) -> None:
    for vi in [*gp.value_info, *gp.output]:
        found[vi.name] = vi
    for node in gp.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _collect_value_info(a.g, found)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    _collect_value_info(sub, found)


def _graphs(graph: Graph):
    yield graph
    for node in graph.walk():
        yield from node.subgraphs


def _inference_model(graph: Graph) -> onnx.ModelProto:
    """The graph as ONNX with only what inference needs: no stale value_info, small constants."""
    inputs = [make_value_info(v) for v in graph.inputs]
    initializers = []
    for v in _all_constants(graph):
        if v.const.size <= LARGEST_CONSTANT_FOR_INFERENCE:
            initializers.append(make_tensor(v))
        else:
            inputs.append(helper.make_tensor_value_info(v.name, v.dtype, list(v.const.shape)))
    # A graph output that is an input or a constant (a model may return its input, or a weight)
    # needs no inference, and given one, ONNX's inference gave no node a shape.
    produced = {id(v) for n in graph.nodes for v in n.outputs}
    outputs = [helper.make_value_info(v.name, onnx.TypeProto()) for v in dict.fromkeys(graph.outputs)
               if id(v) in produced]
    gp = helper.make_graph([_node_proto(n) for n in graph.nodes], graph.name, inputs, outputs, initializers,
                           value_info=_ruled_value_info(graph))
    model = helper.make_model(gp, opset_imports=[helper.make_opsetid(d, v) for d, v in graph.opset_imports.items()])
    model.ir_version = max(graph.ir_version, 4)
    model.functions.extend(graph.functions)
    return model


def _all_constants(graph: Graph) -> list[Value]:
    seen: dict[int, Value] = {}
    for g in _graphs(graph):
        for v in g.constants():
            seen.setdefault(id(v), v)
    return list(seen.values())


def _node_proto(node) -> onnx.NodeProto:
    proto = helper.make_node(node.op_type, [v.name if v is not None else "" for v in node.inputs],
                             [v.name for v in node.outputs], name=node.name, domain=node.domain or None)
    for key, value in node.attrs.items():
        if isinstance(value, Graph):
            proto.attribute.append(helper.make_attribute(key, _subgraph_proto(value)))
        elif isinstance(value, list) and value and isinstance(value[0], Graph):
            proto.attribute.append(helper.make_attribute(key, [_subgraph_proto(g) for g in value]))
        else:
            proto.attribute.append(export_attribute(key, value, node.attr_types.get(key), {}, False))
    for key, value in DEFAULTS_FOR_INFERENCE.get((node.domain, node.op_type), {}).items():
        if key not in node.attrs:
            proto.attribute.append(helper.make_attribute(key, value))
    return proto


def _subgraph_proto(sub: Graph) -> onnx.GraphProto:
    # ONNX reads a constant's value (Unsqueeze's axes, Reshape's shape) only from the initializers
    # of the graph a node is in, not from an enclosing one: repeat the small ones a body reads.
    initializers = [make_tensor(v) for v in sub.constants() if v.const.size <= LARGEST_CONSTANT_FOR_INFERENCE]
    return helper.make_graph([_node_proto(n) for n in sub.nodes], sub.name,
                             [make_value_info(v) for v in sub.inputs],
                             [make_value_info(v) for v in sub.outputs], initializers,
                             value_info=_ruled_value_info(sub))


def _ruled_value_info(graph: Graph) -> list[onnx.ValueInfoProto]:
    """What the registry's shape rules found (a Loop's outputs), which ONNX would not find again
    for the nodes reading them."""
    found = []
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        if entry is not None and entry.shape_rule is not None:
            found += [make_value_info(v) for v in node.outputs if v.is_tensor and v.is_static]
    return found
