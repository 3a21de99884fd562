"""Cortex IR -> ONNX.

Constants become initializers of the innermost graph that holds all their uses, so every exported
model (a whole model or one CU) is self-contained and passes `onnx.checker` with full checks.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ir import dtypes
from ir.bounds import bound_dim_param
from ir.fs import write_bytes_atomically
from ir.graph import Graph, Node, Value, outer_reads


def export_model(graph: Graph, *, with_value_info: bool = True) -> onnx.ModelProto:
    homes = _constant_homes(graph)
    gp = _export_graph(graph, homes, with_value_info)
    opsets = [helper.make_opsetid(domain, version) for domain, version in sorted(graph.opset_imports.items())]
    model = helper.make_model(gp, opset_imports=opsets, producer_name=graph.producer_name or "cortex",
                              producer_version=graph.producer_version)
    # Keep the source IR version unless it is too old to hold what we write (initializers outside
    # the inputs need IR 4).
    model.ir_version = max(graph.ir_version or onnx.IR_VERSION, 4)
    model.model_version = graph.model_version
    model.doc_string = graph.doc_string
    for key, value in graph.metadata.items():
        model.metadata_props.add(key=key, value=value)
    model.functions.extend(graph.functions)
    return model


def save_model(graph_or_model: Graph | onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write atomically: a temporary file in the same folder, then rename."""
    model = export_model(graph_or_model) if isinstance(graph_or_model, Graph) else graph_or_model
    write_bytes_atomically(Path(path), model.SerializeToString())


def make_value_info(value: Value) -> onnx.ValueInfoProto:
    if value.type_proto is not None:
        return helper.make_value_info(value.name, value.type_proto)
    if value.dtype == dtypes.UNDEFINED and value.shape is None:
        return helper.make_empty_tensor_value_info(value.name)
    shape = None if value.shape is None else list(value.shape)
    if value.is_bounded and shape is not None:
        shape[value.bound_axis] = bound_dim_param(shape[value.bound_axis], value.length_key)
    return helper.make_tensor_value_info(value.name, value.dtype, shape)


def make_tensor(value: Value) -> onnx.TensorProto:
    arr = value.const
    if value.dtype not in (dtypes.UNDEFINED, onnx.TensorProto.STRING) and arr.dtype != object:
        # The IR dtype rules: an int4/float8 array may be held in a wider numpy type.
        target = dtypes.to_numpy(value.dtype)
        if arr.dtype != target:
            arr = arr.astype(target)
    tensor = numpy_helper.from_array(np.asarray(arr), value.name)
    if value.dtype not in (dtypes.UNDEFINED,) and tensor.data_type != value.dtype:
        tensor = helper.make_tensor(value.name, value.dtype, arr.shape, arr.flatten().tolist())
    return tensor


def _export_graph(graph: Graph, homes: dict[int, Graph], with_value_info: bool) -> onnx.GraphProto:
    nodes = [_export_node(node, homes, with_value_info) for node in graph.nodes]
    initializers = [make_tensor(v) for v in _constants_homed_in(graph, homes)]
    inputs = [make_value_info(v) for v in graph.inputs]
    outputs = [make_value_info(v) for v in graph.outputs]
    value_info = []
    if with_value_info:
        listed = {v.name for v in [*graph.inputs, *graph.outputs]}
        for node in graph.nodes:
            for out in node.outputs:
                if out.name not in listed and (out.shape is not None or out.dtype or out.type_proto):
                    value_info.append(make_value_info(out))
    return helper.make_graph(nodes, graph.name, inputs, outputs, initializers,
                             doc_string=graph.doc_string or None, value_info=value_info)


def _export_node(node: Node, homes: dict[int, Graph], with_value_info: bool) -> onnx.NodeProto:
    proto = helper.make_node(node.op_type, [v.name if v is not None else "" for v in node.inputs],
                             [v.name for v in node.outputs], name=node.name, domain=node.domain or None,
                             doc_string=node.doc_string or None)
    for key, value in node.attrs.items():
        proto.attribute.append(export_attribute(key, value, node.attr_types.get(key), homes, with_value_info))
    return proto


def export_attribute(key, value, attr_type, homes, with_value_info) -> onnx.AttributeProto:
    A = onnx.AttributeProto
    if isinstance(value, Graph):
        return helper.make_attribute(key, _export_graph(value, homes, with_value_info))
    if isinstance(value, list) and value and isinstance(value[0], Graph):
        return helper.make_attribute(key, [_export_graph(g, homes, with_value_info) for g in value])
    if isinstance(value, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(value))
    if attr_type == A.TENSORS:
        return helper.make_attribute(key, [numpy_helper.from_array(v) for v in value], attr_type=A.TENSORS)
    if attr_type in (A.FLOATS, A.INTS, A.STRINGS, A.TYPE_PROTOS, A.GRAPHS, A.SPARSE_TENSORS) and not value:
        return helper.make_attribute(key, [], attr_type=attr_type)
    if attr_type == A.FLOAT:
        return helper.make_attribute(key, float(value), attr_type=A.FLOAT)
    if attr_type == A.FLOATS:
        return helper.make_attribute(key, [float(v) for v in value], attr_type=A.FLOATS)
    if isinstance(value, np.generic):
        value = value.item()
    return helper.make_attribute(key, value, attr_type=attr_type)


def _constant_homes(root: Graph) -> dict[int, Graph]:
    """Each constant's home: the innermost graph whose scope covers every use."""
    uses: dict[int, list[Graph]] = {}
    by_id: dict[int, Value] = {}

    def visit(graph: Graph, chain: tuple[Graph, ...]):
        chain = chain + (graph,)
        for v in [*(i for n in graph.nodes for i in n.present_inputs), *graph.outputs]:
            if v.is_const:
                uses.setdefault(id(v), []).append(chain)
                by_id[id(v)] = v
        for node in graph.nodes:
            for sub in node.subgraphs:
                visit(sub, chain)

    visit(root, ())
    homes = {}
    for key, chains in uses.items():
        common = chains[0]
        for c in chains[1:]:
            n = 0
            while n < min(len(common), len(c)) and common[n] is c[n]:
                n += 1
            common = common[:n]
        homes[key] = common[-1]
    return homes


def _constants_homed_in(graph: Graph, homes: dict[int, Graph]) -> list[Value]:
    seen: dict[int, Value] = {}

    def collect(g: Graph):
        for v in [*(i for n in g.nodes for i in n.present_inputs), *g.outputs]:
            if v.is_const and homes.get(id(v)) is graph:
                seen.setdefault(id(v), v)
        for n in g.nodes:
            for sub in n.subgraphs:
                collect(sub)

    collect(graph)
    return list(seen.values())


__all__ = ["export_model", "save_model", "make_value_info", "make_tensor",
           "outer_reads"]
