"""A Loop of a few iterations becomes that many copies of its body in the enclosing graph.

Each copy sees its iteration number as a constant, so a body that slices by it (`x[i:i+1]`, as
Range's function body and many exported loops do) gets static shapes that a loop around one body
could not have, and the copies fuse and partition like any other nodes. Larger loops stay Loops
and compile to a loop of the loop-nest IR (`ir/ops/control.py`).

A Loop whose trip count is only bounded (M computed at run time, a condition the body computes)
unrolls to its bound with each iteration guarded: `running` starts as the entry condition (and
0 < M), each copy's state is `Where(running, result, previous)`, its scan row
`Where(running, row, 0)`, and `running` becomes `running and cond_out (and k + 1 < M)`. This runs in
shape inference's fixed-point loop (`InferShapes`), after folding, since M often becomes a
constant only there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir import dtypes
from ir.graph import Graph, Node, Value
from ir.subgraphs import loop_trips
from passes.base import Pass

# Unrolled only while the copies stay few: beyond this a loop in the IR is smaller and compiles faster.
MAX_TRIPS = 16
MAX_UNROLLED_NODES = 128


@dataclass
class UnrollLoops(Pass):
    name = "unroll-loops"
    max_trips: int = MAX_TRIPS
    max_nodes: int = MAX_UNROLLED_NODES

    def run(self, graph: Graph) -> Graph:
        unroll_loops(graph, self.max_trips, self.max_nodes)
        return graph


def unroll_loops(graph: Graph, max_trips: int = MAX_TRIPS, max_nodes: int = MAX_UNROLLED_NODES) -> int:
    """Unroll every small Loop of `graph` (not of its subgraphs: those come up once their owner is
    unrolled); returns how many were."""
    opset = graph.opset_imports.get("", 21)
    nodes, unrolled = [], 0
    for node in graph.nodes:
        trips = loop_trips(node) if node.op_type == "Loop" and not node.domain else None
        extent = None if trips is None else (trips.count if trips.count is not None else trips.bound)
        body = node.attrs.get("body") if trips is not None else None
        if (extent is None or not 0 < extent <= max_trips or extent * len(body.nodes) > max_nodes
                or not _unrollable_types(node, trips.stops_early)):
            nodes.append(node)
            continue
        nodes.extend(_Unroller(graph, node, extent, trips.stops_early, opset).nodes())
        unrolled += 1
    graph.nodes = nodes
    return unrolled


def _unrollable_types(node: Node, guarded: bool) -> bool:
    """Scan outputs must be tensors (they are concatenated); so must carried state that a guarded
    copy selects with Where. Unguarded, a carried sequence (a list a scripted loop appends to) just
    passes from copy to copy, and passes/static_sequences.py then reads its elements."""
    body = node.attrs["body"]
    carried = len(node.inputs) - 2
    scans = [*node.outputs[carried:], *body.outputs[1 + carried:]]
    checked = [*node.inputs, *node.outputs, *body.inputs, *body.outputs] if guarded else scans
    return all(v is None or v.is_tensor for v in checked)


class _Unroller:
    def __init__(self, graph: Graph, node: Node, extent: int, guarded: bool, opset: int):
        self.graph, self.node, self.extent, self.guarded, self.opset = graph, node, extent, guarded, opset
        self.prefix = f"{node.name or 'Loop'}_unrolled"
        self.out: list[Node] = []

    def value(self, name: str) -> Value:
        return Value(self.graph.fresh_name(f"{self.prefix}_{name}"))

    def const(self, array, name: str) -> Value:
        array = np.asarray(array)
        v = self.value(name)
        v.const, v.dtype, v.shape = array, dtypes.from_numpy(array.dtype), tuple(array.shape)
        return v

    def emit(self, op_type: str, inputs, name: str, **attrs) -> Value:
        out = self.value(name)
        self.out.append(Node(op_type, list(inputs), [out], dict(attrs), name=self.graph.fresh_name(f"{self.prefix}_{op_type}")))
        return out

    def nodes(self) -> list[Node]:
        node, body = self.node, self.node.attrs["body"]
        carried = len(node.inputs) - 2
        limit = node.inputs[0] if node.inputs and node.inputs[0] is not None and not node.inputs[0].is_const else None
        cond = node.inputs[1] if len(node.inputs) > 1 else None
        states = list(node.inputs[2:])
        running = None
        if self.guarded:
            running = cond if cond is not None else self.const(np.array(True), "true")
            if limit is not None:
                running = self.emit("And", [running, self.less(0, limit)], "running")
        rows: list[list[Value]] = [[] for _ in body.outputs[1 + carried:]]
        for k in range(self.extent):
            mapping = {id(body.inputs[0]): self.const(np.array(k, np.int64), "iteration"),
                       id(body.inputs[1]): running if running is not None else self.const(np.array(True), "true")}
            mapping.update({id(inner): state for inner, state in zip(body.inputs[2:], states)})
            self.out.extend(_clone_nodes(body.nodes, mapping, f"{self.prefix}{k}", self.graph))
            results = [mapping.get(id(v), v) for v in body.outputs]
            new_states = results[1:1 + carried]
            if running is not None:
                new_states = [self.emit("Where", [running, new, old], "state") for new, old in zip(new_states, states)]
            states = new_states
            for row, result in zip(rows, results[1 + carried:]):
                if running is not None:
                    result = self.emit("Where", [running, result, self.const(np.zeros((), _numpy(result)), "zero")], "row")
                row.append(self.unsqueeze(result))
            if running is not None and k + 1 < self.extent:
                running = self.emit("And", [running, results[0]], "running")
                if limit is not None:
                    running = self.emit("And", [running, self.less(k + 1, limit)], "running")
        for out, state in zip(node.outputs[:carried], states):
            self.out.append(Node("Identity", [state], [out], name=self.graph.fresh_name(f"{self.prefix}_{out.name}")))
        for out, row in zip(node.outputs[carried:], rows):
            self.out.append(Node("Concat", row, [out], {"axis": 0}, name=self.graph.fresh_name(f"{self.prefix}_{out.name}")))
        return self.out

    def less(self, k: int, limit: Value) -> Value:
        return self.emit("Less", [self.const(np.array(k, np.int64), "k"), limit], "within")

    def unsqueeze(self, v: Value) -> Value:
        if self.opset >= 13:
            return self.emit("Unsqueeze", [v, self.const(np.array([0], np.int64), "axes")], "row")
        return self.emit("Unsqueeze", [v], "row", axes=[0])


def _numpy(v: Value):
    return dtypes.to_numpy(v.dtype) if v.dtype else np.float32


def _clone_nodes(nodes: list[Node], mapping: dict[int, Value], prefix: str, home: Graph) -> list[Node]:
    """Copies of `nodes` reading `mapping`'s values in place of the originals; every output is a
    fresh value, recorded in `mapping`. Subgraphs are copied too, since they may read the values
    being replaced. `home`: the graph the copies go into (names are unique across its model)."""
    copies = []
    for node in nodes:
        inputs = [None if v is None else mapping.get(id(v), v) for v in node.inputs]
        outputs = []
        for v in node.outputs:
            fresh = Value(home.fresh_name(f"{prefix}_{v.name}"), v.dtype, v.shape, type_proto=v.type_proto)
            mapping[id(v)] = fresh
            outputs.append(fresh)
        attrs = {key: _clone_attr(value, mapping, prefix, home) for key, value in node.attrs.items()}
        copies.append(Node(node.op_type, inputs, outputs, attrs, name=home.fresh_name(f"{prefix}_{node.name}"),
                           domain=node.domain, attr_types=dict(node.attr_types)))
    return copies


def _clone_attr(value, mapping, prefix, home):
    if isinstance(value, Graph):
        return _clone_graph(value, mapping, prefix, home)
    if isinstance(value, list) and value and isinstance(value[0], Graph):
        return [_clone_graph(g, mapping, prefix, home) for g in value]
    return value


def _clone_graph(graph: Graph, mapping: dict[int, Value], prefix: str, home: Graph) -> Graph:
    copy = Graph(name=graph.name, parent=home, opset_imports=dict(graph.opset_imports))
    for v in graph.inputs:
        fresh = Value(home.fresh_name(f"{prefix}_{v.name}"), v.dtype, v.shape, type_proto=v.type_proto)
        mapping[id(v)] = fresh
        copy.inputs.append(fresh)
    copy.nodes = _clone_nodes(graph.nodes, mapping, prefix, copy)
    copy.outputs = [mapping.get(id(v), v) for v in graph.outputs]
    return copy
