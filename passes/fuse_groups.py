"""Mark the groups of nodes a backend runs as one kernel, after folding BatchNormalization into Conv.

A fusion group is an anchor (a contraction such as Conv/MatMul/Gemm, an inference-form
BatchNormalization, or any elementwise op) and
elementwise members whose every input is the anchor's output, another member's output or a
constant, and whose outputs are read only by members, except the one sink whose output is the
group's result. Chains (Conv -> Add -> Relu) are such groups, and so are diamonds such as the erf
GELU after a MatMul: x is read by x / sqrt 2 and by x * 0.5, which meet again at the final Mul.
One member may take an input from outside the group: a residual Add (`residual_operand`: an Add,
or a Sum of two, of a member's output and a non-constant tensor of exactly its shape), resnet's
Conv -> Add(shortcut) -> Relu and a transformer's MatMul -> Add(bias) -> Add(residual), whose
kernels read the residual in their epilogue. Members may also read small broadcast operands from
outside (`_broadcast_operand`: one value, or one per column of the member's output, such as the
scale a_scale * b_scale of a dynamically quantized product) whose producer comes before the anchor
in graph order (passes/hoist_scalars.py puts scalar computations there).
That rule is what keeps every group convex. A path that leaves the group leaves from the sink,
since every other member's output is read only by members; a path that came back would enter a
member through an input that is not a member's output or a constant: the anchor's inputs or the
residual. The anchor cannot be reached from its own descendants. Nor can the residual be reached
from a member: the path would leave from the sink, and the residual Add is the sink or one of its
ancestors, which would make a cycle. So the residual is produced before the anchor runs, or
independently of it. A broadcast operand's producer precedes the anchor in graph order, a
topological order, while every member is a descendant of the anchor: it cannot be reached from one. Partitioning treats a group as one op and never cuts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir.graph import Graph, Node, Value
from ir.ops import CONTRACTION, ELEMENTWISE, kind_of, lookup
from ir.ops.residual_pattern import residual_operand
from passes.base import Pass


@dataclass
class FuseGroups(Pass):
    name = "fuse-groups"
    fold_batch_norm: bool = True

    def run(self, graph: Graph) -> Graph:
        if self.fold_batch_norm:
            fold_scales_and_shifts_into_batch_norms(graph)
            fold_batch_norms_into_convs(graph)
        assign_fusion_groups(graph)
        return graph


# A bound on the members one anchor collects before the sink is chosen (choosing is quadratic).
MAX_GROUP_MEMBERS = 64


def assign_fusion_groups(graph: Graph) -> int:
    """Annotate `node.fusion_group` on every group of two or more fusable nodes; returns the count."""
    for node in graph.nodes:
        node.fusion_group = None
    groups = fusion_groups(graph)
    for count, members in enumerate(groups):
        for member in members:
            member.fusion_group = f"fusion_{count}"
    return len(groups)


def fusion_groups(graph: Graph) -> list[list[Node]]:
    """The groups of two or more fusable nodes, each in graph order, anchors in graph order: the
    one rule, which the loop-nest lowering also asks (`codegen/lower.py`) about a CU's graph, whose
    nodes lost their labels in cu.onnx."""
    users = graph.users()
    graph_outputs = {id(v) for v in graph.outputs}
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    grouped: set[int] = set()
    groups = []
    for node in graph.nodes:
        if id(node) in grouped or not _can_start_group(node):
            continue
        members = _closed_group(node, _candidates(node, users, grouped, order), users, graph_outputs, order)
        if len(members) < 2:
            continue
        groups.append(members)
        grouped.update(id(member) for member in members)
    return groups


def _can_start_group(node: Node) -> bool:
    if node.domain not in ("", "ai.onnx") or node.subgraphs:
        return False
    entry = lookup(node.op_type, node.domain)
    if entry is None:
        return False
    return entry.kind == ELEMENTWISE or (entry.kind == CONTRACTION and (entry.weight_input is not None or entry.fusion_anchor)) \
        or _is_inference_batch_norm(node)


def _is_inference_batch_norm(node: Node) -> bool:
    """BatchNormalization with constant statistics: a per-channel x * scale + shift, which a
    following Relu can join (its lowering applies the Relu in the same pass)."""
    return (node.op_type == "BatchNormalization" and len(node.present_inputs) == 5 and len(node.outputs) == 1
            and not node.attrs.get("training_mode", 0) and all(v.is_const for v in node.inputs[1:5]))


def _is_member_kind(node: Node) -> bool:
    return (node.domain in ("", "ai.onnx") and not node.subgraphs and len(node.outputs) == 1
            and kind_of(node.op_type, node.domain) == ELEMENTWISE)


def _candidates(anchor: Node, users: dict[Value, list[Node]], grouped: set[int], order: dict[int, int]) -> list[Node]:
    """The anchor and every ungrouped elementwise node reachable from it whose inputs are all the
    anchor's output, a candidate's output, constants or broadcast operands produced before the
    anchor; and at most one residual Add, whose other input comes from outside."""
    if len(anchor.outputs) != 1:
        return [anchor]
    found = [anchor]
    produced = {id(anchor.outputs[0])}
    residual_taken = False
    anchor_at = order[id(anchor)]
    changed = True
    while changed and len(found) < MAX_GROUP_MEMBERS:
        changed = False
        for member in list(found):
            for reader in users.get(member.outputs[0], []):
                if id(reader.outputs[0]) in produced or id(reader) in grouped or not _is_member_kind(reader):
                    continue
                inside = all(v is None or v.is_const or id(v) in produced
                             or _broadcast_operand(v, reader, order, anchor_at) for v in reader.inputs)
                residual = not inside and not residual_taken \
                    and residual_operand(reader, lambda v: id(v) in produced) is not None
                if inside or residual:
                    found.append(reader)
                    produced.add(id(reader.outputs[0]))
                    residual_taken |= residual
                    changed = True
    return found


def _broadcast_operand(value: Value, reader: Node, order: dict[int, int], anchor_at: int) -> bool:
    """Whether `reader` may take `value` from outside its group: one value, or one per column of
    its output (all leading dims 1), produced by a node before the anchor in graph order, or a graph
    input."""
    out = reader.outputs[0]
    if not value.is_static or out.shape is None or not out.is_static or not out.shape:
        return False
    per_column = value.numel == int(out.shape[-1]) and all(d == 1 for d in value.shape[:-1])
    if value.numel != 1 and not per_column:
        return False
    return value.producer is None or order.get(id(value.producer), anchor_at) < anchor_at


def _closed_group(anchor: Node, candidates: list[Node], users, graph_outputs: set[int], order) -> list[Node]:
    """The largest group of candidates ending at one sink: the sink and its ancestors among the
    candidates, every one of them but the sink read only inside the group and not a graph output.
    Ties go to the sink first in graph order (deterministic)."""
    by_output = {id(n.outputs[0]): n for n in candidates if len(n.outputs) == 1}
    best = [anchor]
    for sink in sorted(candidates, key=lambda n: order[id(n)]):
        group, stack = {id(sink): sink}, [sink]
        while stack:
            for v in stack.pop().inputs:
                producer = by_output.get(id(v)) if v is not None else None
                if producer is not None and id(producer) not in group:
                    group[id(producer)] = producer
                    stack.append(producer)
        if len(group) <= len(best) or id(anchor) not in group:
            continue
        closed = all(id(m.outputs[0]) not in graph_outputs
                     and all(id(r) in group for r in users.get(m.outputs[0], []))
                     for m in group.values() if m is not sink)
        if closed:
            best = sorted(group.values(), key=lambda n: order[id(n)])
    return best


def fold_scales_and_shifts_into_batch_norms(graph: Graph) -> int:
    """BatchNormalization (inference form, constant statistics) followed by Muls and Adds of
    per-channel constants (the scale layer Caffe2 exports write after every BN, as densenet121 has)
    becomes one BatchNormalization: (s (x - m) / sqrt(v + e) + b) * c + a is a BN with scale s c and
    bias b c + a. Only while the BN's result has that one reader; returns the nodes removed."""
    users = graph.users()
    graph_outputs = {id(v) for v in graph.outputs}
    removed: set[int] = set()
    for bn in graph.nodes:
        if not _is_inference_batch_norm(bn) or bn.domain not in ("", "ai.onnx") or id(bn) in removed \
                or bn.inputs[1].const.dtype.kind != "f":
            continue
        scale, bias = (bn.inputs[i].const.astype(np.float64) for i in (1, 2))
        folded = 0
        while (step := _scale_or_shift(bn.outputs[0], users, graph_outputs, scale.shape[0])) is not None:
            node, per_channel = step
            if node.op_type == "Mul":
                scale, bias = scale * per_channel, bias * per_channel
            else:
                bias = bias + per_channel
            result = node.outputs[0]
            bn.outputs = [result]
            result.producer = bn
            removed.add(id(node))
            folded += 1
        if folded:
            dtype = bn.inputs[1].const.dtype
            bn.inputs = [bn.inputs[0], *(Value(graph.fresh_name(f"{bn.name}_{what}_folded"), bn.inputs[i].dtype,
                                                tuple(v.shape), v.astype(dtype))
                                          for i, what, v in ((1, "scale", scale), (2, "bias", bias))), *bn.inputs[3:5]]
    graph.nodes = [n for n in graph.nodes if id(n) not in removed]
    return len(removed)


def _scale_or_shift(y: Value, users, graph_outputs: set[int], channels: int):
    """(the Mul or Add that is `y`'s one reader, its constant as one value per channel) when that
    constant is per-channel or a scalar in `y`'s dtype and the result keeps `y`'s shape; else None."""
    readers = users.get(y, [])
    if id(y) in graph_outputs or len(readers) != 1 or y.shape is None or len(y.shape) < 2:
        return None
    node = readers[0]
    if node.op_type not in ("Mul", "Add") or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2 \
            or len(node.outputs) != 1 or (node.inputs[0] is y) == (node.inputs[1] is y):
        return None
    other = node.inputs[1] if node.inputs[0] is y else node.inputs[0]
    if not other.is_const or other.dtype != y.dtype or tuple(node.outputs[0].shape or ()) != tuple(y.shape):
        return None
    c = np.asarray(other.const, dtype=np.float64)
    if c.ndim > len(y.shape):
        return None
    # aligned from the right against (N, C, spatial...): every axis but the channel axis must be 1
    shape = (1,) * (len(y.shape) - c.ndim) + c.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return node, np.broadcast_to(c.reshape(-1), (channels,)).copy()


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
