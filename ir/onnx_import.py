"""ONNX -> Cortex IR.

Initializers and Constant nodes both become constant values (many exported models keep every
weight in a Constant node). Graph inputs that also have an initializer are old-style (IR < 4)
weights and are treated as constants. External data is loaded from beside the model file, through
symbolic links as onnxruntime follows them (a Hugging Face cache links every file to a blob), but
never from outside the model's folder: an absolute location or one with `..` is refused.
Domains other than the default one (ai.onnx.ml, com.microsoft, ...) are carried through as nodes.

Exporter conventions onnxruntime accepts are read the way it reads them: a negative `dim_value` in
a declared shape (PaddlePaddle's `-1` batch) is a dynamic dim, and so is a zero in the declared
shape of a graph output or a value_info, which onnxruntime does not enforce; a zero in a graph
input's shape is a real empty dim (onnxruntime refuses any other size there). Shapes of
initializers and Constant nodes are data, never declarations. Domains listed in opset_import that
no node uses (older converters list `com.microsoft.mlfeaturizers`, `ai.onnx.training`...) are
dropped if Cortex does not know them; a node of such a domain is one error naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from ir import dtypes
from ir.bounds import parse_bound_dim_param
from ir.errors import ModelError, UnsupportedError
from ir.graph import CycleError, Graph, Node, Value

KNOWN_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training",
                 "ai.onnx.preview", "com.microsoft.nchwc", "org.pytorch.aten", "pkg.onnxscript.torch_lib"}


def load_model(path: str | os.PathLike) -> Graph:
    """Read an ONNX file and convert it; any problem with the file is one ModelError line."""
    return import_model(read_model_proto(path))


def read_model_proto(path: str | os.PathLike) -> onnx.ModelProto:
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, expected an .onnx file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror}") from None
    if not data:
        raise ModelError(f"{path}: empty file, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelError(f"{path}: not a valid ONNX model (protobuf parse failed: {e})") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelError(f"{path}: not a valid ONNX model (no graph)")
    if not model.opset_import and model.ir_version == 0:
        raise ModelError(f"{path}: not a valid ONNX model (no ir_version and no opset_import)")
    bad = first_invalid_utf8(model)
    if bad is not None:
        where, raw = bad
        raise ModelError(f"{path}: {where} is not valid UTF-8 ({raw[:40]!r}); ONNX strings must be UTF-8")
    load_external_data(model, path)
    return model


def load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Read every tensor stored outside `path` into the model (onnx's own loader refuses a
    symbolic link, which onnxruntime follows)."""
    for tensor in onnx.external_data_helper._get_all_tensors(model):
        if onnx.external_data_helper.uses_external_data(tensor):
            tensor.raw_data = _external_bytes(tensor, path)
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def _external_bytes(tensor: onnx.TensorProto, path: Path) -> bytes:
    info = onnx.external_data_helper.ExternalDataInfo(tensor)
    where = f"{path}: tensor {tensor.name!r}"
    location = Path(info.location or "")
    if not info.location or location.is_absolute() or ".." in location.parts:
        raise ModelError(f"{where}: external data location {info.location!r} must be a file inside the model's folder")
    file = path.parent / location
    offset = int(info.offset or 0)
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int(info.length) if info.length else size - offset
            if offset < 0 or length < 0 or offset + length > size:
                raise ModelError(f"{where}: external data at offset {offset}, length {length} lies past the end of "
                                 f"{file} ({size} bytes)")
            f.seek(offset)
            return f.read(length)
    except OSError as e:
        raise ModelError(f"{where}: cannot read external data {file}: {e.strerror}") from None


def first_invalid_utf8(message, where: str = "") -> tuple[str, bytes] | None:
    """The first string of `message` (names, doc strings, metadata, attribute strings) that is not
    UTF-8, as (its place, its bytes). protobuf hands such a proto2 string field back as bytes
    instead of str. String tensors hold arbitrary bytes: only a tensor's name is checked."""
    for field, value in message.ListFields():
        items = list(value) if field.is_repeated else [value]
        for i, item in enumerate(items):
            label = _label(message, field.name, where) + (f"[{i}]" if field.is_repeated else "")
            if field.type == field.TYPE_MESSAGE:
                found = (_invalid_name(item, label) if isinstance(item, onnx.TensorProto)
                         else first_invalid_utf8(item, label))
                if found is not None:
                    return found
            elif field.type == field.TYPE_STRING or (isinstance(message, onnx.AttributeProto)
                                                      and field.name in ("s", "strings")):
                if isinstance(item, bytes) and not _is_utf8(item):
                    return label, item
    return None


def _invalid_name(tensor: onnx.TensorProto, where: str) -> tuple[str, bytes] | None:
    for field in ("name", "doc_string"):
        value = getattr(tensor, field)
        if isinstance(value, bytes):
            return f"{where}.{field}", value
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _label(message, field: str, where: str) -> str:
    """`graph.node[3](Relu).name`, `...attribute[0](auto_pad).s`: the op type or attribute name
    helps find the place when the broken string is the node's own name."""
    tag_field = "op_type" if isinstance(message, onnx.NodeProto) else \
        "name" if isinstance(message, onnx.AttributeProto) else None
    tag = getattr(message, tag_field) if tag_field else None
    if tag and isinstance(tag, str) and field != tag_field:
        where = f"{where}({tag})"
    return f"{where}.{field}" if where else field


def import_model(model: onnx.ModelProto) -> Graph:
    opsets = {op.domain if op.domain != "ai.onnx" else "": op.version for op in model.opset_import}
    known = KNOWN_DOMAINS | {f.domain for f in model.functions}
    for where, node in _all_node_protos(model):
        if node.domain not in known:
            raise UnsupportedError(f"{where}node {node.name or node.op_type!r} ({node.op_type}) uses op domain "
                                   f"{node.domain!r}, which Cortex does not support")
    opsets = {domain: version for domain, version in opsets.items() if domain in known}
    graph = _Importer(opsets, _names_in(model.graph)).import_graph(model.graph, parent=None, scope={})
    graph.opset_imports = opsets
    graph.ir_version = model.ir_version
    graph.producer_name = model.producer_name
    graph.producer_version = model.producer_version
    graph.model_version = model.model_version
    graph.doc_string = model.doc_string
    graph.metadata = {p.key: p.value for p in model.metadata_props}
    graph.functions = list(model.functions)
    return graph


class _Importer:
    def __init__(self, opsets: dict[str, int], taken_names: set[str]):
        self.opsets = opsets
        # Every name in the model: names made up for omitted outputs must be unique model-wide (SSA).
        self.taken_names = taken_names
        self.node_names: set[str] = set()
        self.functions: set[tuple[str, str]] = set()

    def import_graph(self, gp: onnx.GraphProto, parent: Graph | None, scope: dict[str, Value]) -> Graph:
        scope = dict(scope)  # inner names shadow nothing outside; SSA makes this a plain copy
        graph = Graph(name=gp.name or "main", parent=parent, doc_string=gp.doc_string)
        value_info = {vi.name: vi for vi in [*gp.input, *gp.output, *gp.value_info]}

        for init in gp.initializer:
            scope[init.name] = Value(init.name, init.data_type, tuple(init.dims), _to_array(init))
        for sparse in gp.sparse_initializer:
            arr = _sparse_to_array(sparse)
            scope[sparse.values.name] = Value(sparse.values.name, sparse.values.data_type, arr.shape, arr)
        for vi in gp.input:
            if vi.name in scope and scope[vi.name].is_const:
                continue  # old-style weight listed among the inputs
            value = _value_from_info(vi, graph_input=True)
            scope[vi.name] = value
            graph.inputs.append(value)

        def lookup(name: str, node_proto: onnx.NodeProto) -> Value | None:
            if name == "":
                return None
            if name not in scope:
                label = node_proto.name or node_proto.op_type
                raise ModelError(f"node {label!r} ({node_proto.op_type}) reads {name!r}, "
                                 "which no node, input or initializer provides")
            return scope[name]

        pending: list[tuple[onnx.NodeProto, list[Value]]] = []
        # Define every output first so nodes may appear in any order (ONNX requires topological
        # order, but many real models break that rule and onnxruntime accepts them).
        for np_ in gp.node:
            outs = []
            for name in np_.output:
                if name == "":
                    outs.append(Value(self._fresh_unused_name()))
                    continue
                if name in scope and (scope[name].producer is not None or scope[name].is_const
                                      or scope[name] in graph.inputs):
                    raise ModelError(f"node {np_.name or np_.op_type!r} ({np_.op_type}) writes "
                                     f"{name!r}, which is already defined")
                value = _value_from_info(value_info[name]) if name in value_info else Value(name)
                scope[name] = value
                outs.append(value)
            pending.append((np_, outs))

        for np_, outs in pending:
            if np_.domain not in self.opsets and np_.domain != "ai.onnx":
                raise ModelError(f"node {np_.name or np_.op_type!r} ({np_.op_type}) uses op domain "
                                 f"{np_.domain!r}, which the model does not import")
            if np_.op_type == "Constant" and np_.domain in ("", "ai.onnx") and len(outs) == 1:
                self._constant_to_value(np_, outs[0])
                continue
            inputs = [lookup(name, np_) for name in np_.input]
            attrs, attr_types = {}, {}
            for a in np_.attribute:
                attrs[a.name] = self._attribute_value(a, graph, scope)
                attr_types[a.name] = a.type
            node = Node(np_.op_type, inputs, outs, attrs, self._node_name(np_), 
                        "" if np_.domain == "ai.onnx" else np_.domain, attr_types, np_.doc_string)
            graph.nodes.append(node)

        for vo in gp.output:
            if vo.name not in scope:
                raise ModelError(f"graph output {vo.name!r} is not produced by any node")
            value = scope[vo.name]
            if value.shape is None and value.dtype == dtypes.UNDEFINED:
                info = _value_from_info(vo)
                value.dtype, value.shape, value.type_proto = info.dtype, info.shape, info.type_proto
            graph.outputs.append(value)
        try:
            graph.topologically_sort()
        except CycleError as e:
            raise ModelError(str(e)) from None
        return graph

    def _constant_to_value(self, np_: onnx.NodeProto, out: Value) -> None:
        arr, dtype = _constant_array(np_)
        out.const = arr
        out.shape = tuple(arr.shape)
        out.dtype = dtype
        out.producer = None

    def _attribute_value(self, a: onnx.AttributeProto, graph: Graph, scope: dict[str, Value]):
        if a.ref_attr_name:
            raise ModelError(f"attribute {a.name!r} refers to a function attribute outside a function")
        if a.type == onnx.AttributeProto.GRAPH:
            return self.import_graph(a.g, graph, scope)
        if a.type == onnx.AttributeProto.GRAPHS:
            return [self.import_graph(g, graph, scope) for g in a.graphs]
        if a.type == onnx.AttributeProto.TENSOR:
            return _to_array(a.t)
        if a.type == onnx.AttributeProto.TENSORS:
            return [_to_array(t) for t in a.tensors]
        if a.type == onnx.AttributeProto.SPARSE_TENSOR:
            return a.sparse_tensor  # carried as protobuf; nothing in Cortex reads it
        if a.type == onnx.AttributeProto.TYPE_PROTO:
            return a.tp
        if a.type == onnx.AttributeProto.TYPE_PROTOS:
            return list(a.type_protos)
        value = onnx.helper.get_attribute_value(a)
        if isinstance(value, bytes):
            return value.decode("utf-8", errors="surrogateescape")
        if isinstance(value, list) and value and isinstance(value[0], bytes):
            return [v.decode("utf-8", errors="surrogateescape") for v in value]
        return list(value) if isinstance(value, (list, tuple)) else value

    def _node_name(self, np_: onnx.NodeProto) -> str:
        base = np_.name or f"{np_.op_type}_{len(self.node_names)}"
        name = base
        i = 1
        while name in self.node_names:
            name = f"{base}__{i}"
            i += 1
        self.node_names.add(name)
        return name

    def _fresh_unused_name(self) -> str:
        i = len(self.taken_names)
        while f"__unused_{i}" in self.taken_names:
            i += 1
        self.taken_names.add(f"__unused_{i}")
        return f"__unused_{i}"


def _all_node_protos(model: onnx.ModelProto):
    """(where, node) for every node: the main graph's, its subgraphs', and model-local functions'."""
    for node in _graph_node_protos(model.graph):
        yield "", node
    for function in model.functions:
        for node in function.node:
            for inner in [node, *_subgraph_node_protos(node)]:
                yield f"function {function.name!r}: ", inner


def _graph_node_protos(gp: onnx.GraphProto):
    for node in gp.node:
        yield node
        yield from _subgraph_node_protos(node)


def _subgraph_node_protos(node: onnx.NodeProto):
    for a in node.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            yield from _graph_node_protos(sub)


def _names_in(gp: onnx.GraphProto) -> set[str]:
    names = {v.name for v in [*gp.input, *gp.output, *gp.initializer]}
    for node in gp.node:
        names.update(node.input)
        names.update(node.output)
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                names |= _names_in(sub)
    return names


def _read_bound(value: Value) -> None:
    """A dim a CU declared as bounded (ir/bounds.py) is its static bound, and the value bounded."""
    bounds = [(k, parse_bound_dim_param(d)) for k, d in enumerate(value.shape or ())]
    bounds = [(k, b) for k, b in bounds if b is not None]
    if len(bounds) == 1:
        (axis, (bound, key)), = bounds
        value.shape = tuple(bound if k == axis else d for k, d in enumerate(value.shape))
        value.bound_axis, value.length_key = axis, key


def _value_from_info(vi: onnx.ValueInfoProto, graph_input: bool = False) -> Value:
    t = vi.type
    if t.HasField("tensor_type"):
        tt = t.tensor_type
        shape, zeros = None, ()
        if tt.HasField("shape"):
            shape = tuple(_dim(d, graph_input) for d in tt.shape.dim)
            zeros = tuple(i for i, d in enumerate(tt.shape.dim)
                          if not graph_input and d.HasField("dim_value") and d.dim_value == 0)
        value = Value(vi.name, tt.elem_type, shape, declared_zero_axes=zeros)
        _read_bound(value)
        return value
    if not t.WhichOneof("value"):
        return Value(vi.name)
    tp = onnx.TypeProto()
    tp.CopyFrom(t)
    return Value(vi.name, dtypes.UNDEFINED, None, type_proto=tp)


def _dim(d: onnx.TensorShapeProto.Dimension, graph_input: bool):
    """A declared dim: its size, its symbol, or None. `-1` (and, outside graph inputs, `0`) is how
    some exporters write a dynamic dim; onnxruntime treats them so (module docstring). A declared 0
    outside the inputs stays a hint (`Value.declared_zero_axes`) for where inference finds nothing."""
    if d.HasField("dim_value"):
        size = int(d.dim_value)
        return size if size > 0 or (size == 0 and graph_input) else None
    if d.HasField("dim_param") and d.dim_param:
        return d.dim_param
    return None


def _to_array(t: onnx.TensorProto) -> np.ndarray:
    try:
        arr = numpy_helper.to_array(t)
    except Exception as e:  # a truncated or inconsistent tensor
        raise ModelError(f"tensor {t.name!r}: cannot decode its data ({e})") from None
    return arr


def _sparse_to_array(sp: onnx.SparseTensorProto) -> np.ndarray:
    values = _to_array(sp.values)
    indices = _to_array(sp.indices).astype(np.int64)
    dense = np.zeros(tuple(sp.dims), dtype=values.dtype)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense


def _constant_array(np_: onnx.NodeProto) -> tuple[np.ndarray, int]:
    attrs = {a.name: a for a in np_.attribute}
    label = f"node {np_.name or 'Constant'!r} (Constant)"
    if len(attrs) != 1:
        raise ModelError(f"{label} must have exactly one value attribute, has {sorted(attrs)}")
    (key, a), = attrs.items()
    if key == "value":
        return _to_array(a.t), a.t.data_type
    if key == "sparse_value":
        return _sparse_to_array(a.sparse_tensor), a.sparse_tensor.values.data_type
    arr = _constant_scalar_or_list(key, a, label)
    return arr, _dtype_of_array(arr)


def _constant_scalar_or_list(key: str, a: onnx.AttributeProto, label: str) -> np.ndarray:
    if key == "value_float":
        return np.array(a.f, dtype=np.float32)
    if key == "value_floats":
        return np.array(list(a.floats), dtype=np.float32)
    if key == "value_int":
        return np.array(a.i, dtype=np.int64)
    if key == "value_ints":
        return np.array(list(a.ints), dtype=np.int64)
    if key == "value_string":
        return np.array(a.s.decode("utf-8", errors="surrogateescape"), dtype=object)
    if key == "value_strings":
        return np.array([s.decode("utf-8", errors="surrogateescape") for s in a.strings], dtype=object)
    raise ModelError(f"{label} has unknown attribute {key!r}")


def _dtype_of_array(arr: np.ndarray) -> int:
    if arr.dtype == object:
        return onnx.TensorProto.STRING
    return dtypes.from_numpy(arr.dtype)
