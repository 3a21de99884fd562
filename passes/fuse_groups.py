"""Mark the groups of nodes a backend runs as one kernel, after folding BatchNormalization into Conv.

A fusion group is a chain: an anchor (a contraction such as Conv/MatMul/Gemm, or any elementwise op)
followed by elementwise ops, where each link's output is read by the next link only. That rule is
what keeps every group convex: nothing can leave the chain and come back into it, because the only
reader of each intermediate value is the next member. Partitioning treats a group as one op and
never cuts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir.graph import Graph, Node, Value
from ir.ops import CONTRACTION, ELEMENTWISE, kind_of, lookup
from passes.base import Pass


@dataclass
class FuseGroups(Pass):
    name = "fuse-groups"
    fold_batch_norm: bool = True

    def run(self, graph: Graph) -> Graph:
        if self.fold_batch_norm:
            fold_batch_norms_into_convs(graph)
        assign_fusion_groups(graph)
        return graph


def assign_fusion_groups(graph: Graph) -> int:
    """Annotate `node.fusion_group` on every chain of two or more fusable nodes; returns the count."""
    for node in graph.nodes:
        node.fusion_group = None
    users = graph.users()
    graph_outputs = {id(v) for v in graph.outputs}
    grouped: set[int] = set()
    count = 0
    for node in graph.nodes:
        if id(node) in grouped or not _can_start_group(node):
            continue
        chain = [node]
        while (nxt := _next_link(chain[-1], users, graph_outputs)) is not None and id(nxt) not in grouped:
            chain.append(nxt)
        if len(chain) < 2:
            continue
        label = f"fusion_{count}"
        count += 1
        for member in chain:
            member.fusion_group = label
            grouped.add(id(member))
    return count


def _can_start_group(node: Node) -> bool:
    if node.domain not in ("", "ai.onnx") or node.subgraphs:
        return False
    entry = lookup(node.op_type, node.domain)
    if entry is None:
        return False
    return entry.kind == ELEMENTWISE or (entry.kind == CONTRACTION and entry.weight_input is not None)


def _next_link(node: Node, users: dict[Value, list[Node]], graph_outputs: set[int]) -> Node | None:
    """The one elementwise reader of a single-output node's result, if the chain may continue."""
    if len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    readers = users.get(out, [])
    if id(out) in graph_outputs or len({id(r) for r in readers}) != 1:
        return None
    reader = readers[0]
    if reader.domain not in ("", "ai.onnx") or reader.subgraphs or len(reader.outputs) != 1:
        return None
    if kind_of(reader.op_type, reader.domain) != ELEMENTWISE:
        return None
    return reader


def fold_batch_norms_into_convs(graph: Graph) -> int:
    """Conv -> BatchNormalization (inference form, constant statistics) becomes one Conv whose weights
    and bias carry the normalisation. Only when the Conv's result has no other reader."""
    users = graph.users()
    graph_outputs = {id(v) for v in graph.outputs}
    removed: set[int] = set()
    for bn in graph.nodes:
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx"):
            continue
        conv = _foldable_conv(bn, users, graph_outputs)
        if conv is None:
            continue
        scale, bias, mean, var = (v.const.astype(np.float64) for v in bn.inputs[1:5])
        eps = float(bn.attrs.get("epsilon", 1e-5))
        weight = conv.inputs[1]
        factor = scale / np.sqrt(var + eps)
        dtype = weight.const.dtype
        new_w = (weight.const.astype(np.float64) * factor.reshape((-1,) + (1,) * (weight.const.ndim - 1))).astype(dtype)
        old_b = conv.inputs[2].const.astype(np.float64) if len(conv.inputs) > 2 and conv.inputs[2] is not None \
            else np.zeros_like(mean)
        new_b = ((old_b - mean) * factor + bias).astype(dtype)
        w_value = Value(graph.fresh_name(f"{weight.name}_bn_folded"), weight.dtype, tuple(new_w.shape), new_w)
        b_value = Value(graph.fresh_name(f"{conv.name}_bias_bn_folded"), weight.dtype, tuple(new_b.shape), new_b)
        conv.inputs = [conv.inputs[0], w_value, b_value]
        result = bn.outputs[0]
        conv.outputs = [result]
        result.producer = conv
        removed.add(id(bn))
    graph.nodes = [n for n in graph.nodes if id(n) not in removed]
    return len(removed)


def _foldable_conv(bn: Node, users, graph_outputs: set[int]) -> Node | None:
    if len(bn.present_inputs) != 5 or bn.attrs.get("training_mode", 0) or len(bn.outputs) != 1:
        return None
    if not all(v.is_const for v in bn.inputs[1:5]):
        return None
    x = bn.inputs[0]
    conv = x.producer
    if conv is None or conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx"):
        return None
    if id(x) in graph_outputs or len(users.get(x, [])) != 1 or len(conv.outputs) != 1:
        return None
    weight = conv.inputs[1]
    if weight is None or not weight.is_const or weight.const.dtype.kind != "f":
        return None
    if len(conv.inputs) > 2 and conv.inputs[2] is not None and not conv.inputs[2].is_const:
        return None
    channels = weight.const.shape[0]
    if any(v.const.size != channels for v in bn.inputs[1:5]):
        return None
    return conv
