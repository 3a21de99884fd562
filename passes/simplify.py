"""Remove ops that do nothing and collapse pairs that cancel.

- Identity, inference-mode Dropout, Cast to the same type, a view (Reshape, Squeeze...: what the
  registry calls `view`) whose output shape equals the input's: the output becomes an alias of the
  input.
- Transpose of a Transpose: one Transpose with the composed permutation, or none if it is the
  identity permutation.
- Reshape of a Reshape: the inner one is skipped (Reshape only depends on element order).
Graph outputs keep their names: when the removed node produced one, the value it forwarded is
renamed instead, unless that value is itself part of the interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir.graph import Graph, Node, Value
from ir.ops.registry import is_view
from passes.base import Pass


@dataclass
class Simplify(Pass):
    name = "simplify"

    def run(self, graph: Graph) -> Graph:
        users = graph.users()
        interface = {id(v) for v in [*graph.inputs, *graph.outputs]}
        aliases: dict[int, Value] = {}  # applied once at the end: one walk, not one per removal

        def resolve(v: Value | None) -> Value | None:
            while v is not None and id(v) in aliases:
                v = aliases[id(v)]
            return v

        kept = []
        for node in graph.nodes:
            node.inputs = [resolve(v) for v in node.inputs]
            _collapse_pairs(node)
            src = _forwarded_input(node, users)
            out = node.outputs[0] if node.outputs else None
            if src is None:
                kept.append(node)
            elif id(out) not in interface:
                aliases[id(out)] = src
            elif _rename_producer_output(graph, src, out, interface):
                # Later nodes may still read `src` through an alias of a no-op removed earlier in
                # this walk; `src` no longer exists, so those reads must land on `out`.
                aliases[id(src)] = out
            else:
                kept.append(node)
        graph.nodes = kept
        if aliases:
            for node in graph.walk():
                node.inputs = [resolve(v) for v in node.inputs]
            for sub in (s for n in graph.walk() for s in n.subgraphs):
                sub.outputs = [resolve(v) for v in sub.outputs]
        for node in graph.nodes:
            for sub in node.subgraphs:
                self.run(sub)
        return graph


def _forwarded_input(node: Node, users) -> Value | None:
    """The input this node passes through unchanged, if it is a no-op."""
    if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
        return None
    x, out = node.inputs[0], node.outputs[0]
    if node.op_type == "Identity":
        return x
    if node.op_type == "Dropout":
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if (training is None or (training.is_const and not bool(training.const))) and \
                (len(node.outputs) < 2 or not users.get(node.outputs[1])):
            return x
        return None
    if node.op_type == "Cast" and x.dtype and node.attrs.get("to") == x.dtype:
        return x
    if is_view(node.op_type, node.domain) and x.is_static and out.is_static and x.shape == out.shape:
        return x
    return None


def _rename_producer_output(graph: Graph, src: Value, out: Value, interface: set[int]) -> bool:
    """Let the producer of `src` write the graph output `out` directly, keeping the output's name.
    False when `src` is itself part of the interface (input -> Identity -> output must stay)."""
    producer = src.producer
    if id(src) in interface or src.is_const or producer is None or producer not in graph.nodes:
        return False
    graph.replace_all_uses(src, out)
    producer.outputs = [out if v is src else v for v in producer.outputs]
    out.producer = producer
    return True


def _collapse_pairs(node: Node) -> None:
    if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
        return
    inner = node.inputs[0].producer
    if inner is None or inner.op_type != node.op_type or inner.domain != node.domain:
        return
    if node.op_type == "Transpose" and "perm" in node.attrs and "perm" in inner.attrs:
        outer_perm, inner_perm = node.attrs["perm"], inner.attrs["perm"]
        composed = [inner_perm[p] for p in outer_perm]
        node.inputs[0] = inner.inputs[0]
        if composed == list(range(len(composed))):
            node.op_type, node.attrs, node.attr_types = "Identity", {}, {}
        else:
            node.attrs["perm"] = composed
    elif node.op_type == "Reshape" and len(node.inputs) > 1 and node.inputs[1] is not None \
            and node.inputs[1].is_const and not _has_zero_or_copy_dims(node.inputs[1].const, node):
        node.inputs[0] = inner.inputs[0]


def _has_zero_or_copy_dims(shape: np.ndarray, node: Node) -> bool:
    # A 0 in the target shape copies the input's dim, which changes meaning if the input changes.
    return bool(np.any(shape == 0)) and not node.attrs.get("allowzero", 0)
