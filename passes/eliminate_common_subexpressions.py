"""Merge nodes that compute the same thing, and constants that hold the same bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir.fs import sha256_bytes
from ir.graph import Graph, Node, Value
from ir.ops import lookup
from passes.base import Pass


@dataclass
class EliminateCommonSubexpressions(Pass):
    name = "eliminate-common-subexpressions"
    # Larger constants are compared too, but hashing every weight of a big model costs seconds.
    max_constant_bytes: int = 1 << 20

    def run(self, graph: Graph) -> Graph:
        replacement: dict[int, Value] = {}
        self._merge_constants(graph, replacement)
        seen: dict[tuple, Node] = {}
        kept = []
        for node in graph.nodes:
            node.inputs = [replacement.get(id(v), v) if v is not None else None for v in node.inputs]
            key = _node_key(node)
            twin = seen.get(key) if key is not None else None
            if twin is None:
                if key is not None:
                    seen[key] = node
                kept.append(node)
                continue
            for mine, theirs in zip(node.outputs, twin.outputs):
                replacement[id(mine)] = theirs
        graph.nodes = kept
        if replacement:
            _rewire_subgraphs_and_outputs(graph, replacement)
        return graph

    def _merge_constants(self, graph: Graph, replacement: dict[int, Value]) -> None:
        by_content: dict[tuple, Value] = {}
        for v in graph.constants():
            arr = v.const
            if arr.dtype == object or arr.nbytes > self.max_constant_bytes:
                continue
            digest = sha256_bytes(np.ascontiguousarray(arr).tobytes())
            key = (v.dtype, arr.shape, str(arr.dtype), digest)
            if key in by_content:
                replacement[id(v)] = by_content[key]
            else:
                by_content[key] = v


def _node_key(node: Node) -> tuple | None:
    if node.subgraphs:
        return None
    entry = lookup(node.op_type, node.domain)
    if entry is not None and not entry.deterministic:
        return None
    try:
        attrs = tuple(sorted((k, _hashable(v)) for k, v in node.attrs.items()))
    except TypeError:
        return None
    return (node.domain, node.op_type, len(node.outputs),
            tuple(id(v) if v is not None else None for v in node.inputs), attrs)


def _hashable(value):
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    hash(value)
    return value


def _rewire_subgraphs_and_outputs(graph: Graph, replacement: dict[int, Value]) -> None:
    """Graph outputs keep their names: a merged output is re-exposed through its twin's producer
    only when that does not rename an interface value."""
    for node in graph.walk():
        node.inputs = [replacement.get(id(v), v) if v is not None else None for v in node.inputs]
    for sub in (s for n in graph.walk() for s in n.subgraphs):
        sub.outputs = [replacement.get(id(v), v) for v in sub.outputs]
    outputs = []
    for v in graph.outputs:
        new = replacement.get(id(v))
        if new is None:
            outputs.append(v)
        else:
            # The merged node is gone; keep the output's name by adding an Identity.
            graph.nodes.append(Node("Identity", [new], [v], name=graph.fresh_name(f"{v.name}_alias")))
            outputs.append(v)
    graph.outputs = outputs
