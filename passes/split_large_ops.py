"""Split an op whose weights alone exceed the CU size cap along its output channels.

The registry says which input of an op is its weight and on which axes of the weight and of the
output the output channels live (`weight_input`, `weight_axis`, `output_axis`). A too-large op
becomes k copies, each owning a contiguous slice of the channels, joined by a Concat along the
output's channel axis. The fused epilogue that follows the op (bias Add, Relu, Mul by a per-channel
scale...) is split with it as long as its other inputs are constants that are per-channel or
broadcast along that axis; the rest of the epilogue stays after the Concat. A too-large recurrent
layer is first split into its input projection (a MatMul, split here like any other) and its
recurrence (passes/split_recurrent.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import AttributeProto

from ir import dtypes
from ir.errors import CortexError
from ir.graph import Graph, Node, Value
from ir.ops import lookup
from passes.base import Pass
from passes.split_recurrent import split_recurrent


@dataclass
class SplitLargeOps(Pass):
    name = "split-large-ops"
    max_cu_size: int | None = None

    def run(self, graph: Graph) -> Graph:
        if self.max_cu_size is not None:
            split_large_ops(graph, self.max_cu_size)
        return graph


def split_large_ops(graph: Graph, max_params: int, oversized: dict[int, str] | None = None) -> int:
    """Rewrite every fusion group (or lone node) holding more than `max_params` parameters. What
    cannot be divided by its nature (one direction's recurrence) is left whole and named in
    `oversized` (id(node) -> why), for the partitioner to place alone."""
    oversized = oversized if oversized is not None else {}
    recurrent = split_recurrent(graph, max_params, oversized)
    replaced: dict[int, list[Node]] = {}
    for unit in fusion_units(graph):
        if unit_params(unit) <= max_params or any(id(node) in oversized for node in unit):
            continue
        new_nodes = split_unit(graph, unit, max_params)
        replaced[id(unit[0])] = new_nodes
        for node in unit[1:]:
            replaced[id(node)] = []
    if not replaced:
        return recurrent
    graph.nodes = [n for node in graph.nodes for n in replaced.get(id(node), [node])]
    graph.topologically_sort()
    return recurrent + sum(1 for nodes in replaced.values() if nodes)


def fusion_units(graph: Graph) -> list[list[Node]]:
    """The graph's fusion groups and lone nodes, each in graph order: what splits as one."""
    groups: dict[str, list[Node]] = {}
    units: list[list[Node]] = []
    for node in graph.nodes:
        if node.fusion_group is None:
            units.append([node])
        elif node.fusion_group not in groups:
            groups[node.fusion_group] = [node]
            units.append(groups[node.fusion_group])
        else:
            groups[node.fusion_group].append(node)
    return units


def unit_params(nodes: list[Node]) -> int:
    consts = {id(v): v for n in nodes for v in n.present_inputs if v.is_const}
    return sum(int(v.const.size) for v in consts.values())


SLICED_BY_OP = -1     # an anchor input the op's own `slice_channels` divides


@dataclass
class _Plan:
    """How each split node's inputs divide: `axes[i]` is the input axis to slice, or None to share."""
    node: Node
    axes: list[int | None]


def split_unit(graph: Graph, unit: list[Node], max_params: int | None = None, pieces: int | None = None,
               piece_of: dict[int, int] | None = None) -> list[Node]:
    """The nodes replacing `unit`: its anchor (and the epilogue that splits with it) in slices of
    at most `max_params` parameters, or in `pieces` balanced slices, joined by a Concat. With
    `piece_of`, each slice's nodes are recorded there (id(node) -> slice index)."""
    # Fusion groups start at their anchor (see fuse_groups): only the first node can own the weight.
    anchor = unit[0]
    if _weight_axis(anchor) is None:
        worst = max(unit, key=lambda n: unit_params([n]))
        raise CortexError(f"{worst.describe()} holds {unit_params(unit):,} parameters, more than "
                          f"--max-cu-size {max_params:,}, and Cortex cannot split {worst.op_type} along its "
                          "output channels; raise --max-cu-size")
    entry = lookup(anchor.op_type, anchor.domain)
    out = anchor.outputs[0]
    channel_axis = entry.output_axis(anchor) % len(out.shape) - len(out.shape)  # negative: broadcast-safe
    channels = out.shape[channel_axis]
    plans = [_Plan(anchor, _anchor_axes(anchor, entry, channels, channel_axis))]
    # The epilogue splits with the anchor while its constants are per-channel or broadcast and its
    # other inputs are split nodes' results (a GELU reads its input twice).
    for node in unit[1:]:
        axes = epilogue_axes(node, {id(p.node.outputs[0]) for p in plans}, channels, channel_axis)
        if axes is None:
            break
        plans.append(_Plan(node, axes))
    # A group need not be a chain (a GELU diamond reads the anchor's output twice): what stays after
    # the join may read only the last split node's output, the one the Concat rebuilds.
    while len(plans) > 1 and any(v is p.node.outputs[0] for p in plans[:-1]
                                 for n in unit[len(plans):] for v in n.inputs):
        plans.pop()
    rest = unit[len(plans):]

    per_channel, shared = 0, {}
    for plan in plans:
        for v, axis in zip(plan.node.inputs, plan.axes):
            if v is None or not v.is_const:
                continue
            if axis is None:
                shared[id(v)] = int(v.const.size)
            else:
                per_channel += int(v.const.size) // channels
    shared_params = sum(shared.values())
    conv_groups = int(anchor.attrs.get("group", 1)) if anchor.op_type == "Conv" else 1
    if pieces is not None:
        # Every output channel costs the same flops, so equal channel counts balance the slices.
        ranges = _channel_ranges(channels, math.ceil(channels / pieces), conv_groups)
    else:
        if shared_params + per_channel > max_params:
            raise CortexError(f"{anchor.describe()}: one output channel needs {shared_params + per_channel:,} "
                              f"parameters, more than --max-cu-size {max_params:,}; raise --max-cu-size")
        ranges = _channel_ranges(channels, (max_params - shared_params) // per_channel, conv_groups)

    label = anchor.fusion_group or anchor.name
    new_nodes: list[Node] = []
    piece_outputs = []
    for k, (lo, hi) in enumerate(ranges):
        first_of_slice = len(new_nodes)
        group = f"{label}/part{k}" if len(plans) > 1 else None
        chained: Value | None = None   # the last split node's piece
        piece_of_value: dict[int, Value] = {}   # a split node's result -> its piece in this slice
        for plan in plans:
            entry_of_node = lookup(plan.node.op_type, plan.node.domain)
            sliced_by_op = entry_of_node.slice_channels(plan.node, lo, hi) \
                if plan.node is anchor and entry_of_node.slice_channels is not None else ({}, {})
            inputs = []
            for v, axis in zip(plan.node.inputs, plan.axes):
                if v is not None and id(v) in piece_of_value:
                    inputs.append(piece_of_value[id(v)])
                elif v is not None and axis == SLICED_BY_OP:
                    part = sliced_by_op[0][len(inputs)]
                    inputs.append(Value(graph.fresh_name(f"{v.name}_part{k}"), v.dtype, tuple(part.shape), part))
                elif v is not None and axis is not None:
                    inputs.append(slice_constant(graph, v, axis, lo, hi, k))
                else:
                    inputs.append(v)
            attrs = {**plan.node.attrs, **sliced_by_op[1]}
            if plan.node is anchor and conv_groups > 1:
                inputs[0], attrs["group"] = _input_channels_for(graph, anchor, conv_groups, lo, hi, k, new_nodes)
            result = plan.node.outputs[0]
            shape = list(result.shape)
            shape[channel_axis] = hi - lo
            chained = Value(graph.fresh_name(f"{result.name}_part{k}"), result.dtype, tuple(shape))
            piece_of_value[id(result)] = chained
            new_nodes.append(Node(plan.node.op_type, inputs, [chained], attrs,
                                  graph.fresh_name(f"{plan.node.name}_part{k}"), plan.node.domain,
                                  dict(plan.node.attr_types), plan.node.doc_string, group))
        piece_outputs.append(chained)
        if piece_of is not None:
            piece_of.update((id(n), k) for n in new_nodes[first_of_slice:])
    # The Concat produces the original value, so every reader (and the model's outputs) is unchanged.
    joined = plans[-1].node.outputs[0]
    new_nodes.append(Node("Concat", piece_outputs, [joined], {"axis": channel_axis % len(joined.shape)},
                          graph.fresh_name(f"{anchor.name}_join"), attr_types={"axis": AttributeProto.INT}))
    if len(rest) == 1:
        rest[0].fusion_group = None  # what stays after the join is a group only if it is a chain of two
    new_nodes.extend(rest)
    return new_nodes


def _channel_ranges(channels: int, cap: int, conv_groups: int) -> list[tuple[int, int]]:
    """Balanced contiguous output-channel ranges of at most `cap` channels. In a grouped Conv a
    range holds whole groups, or lies inside one group, so each piece reads one slice of the input."""
    def balanced(start: int, count: int, pieces: int) -> list[tuple[int, int]]:
        bounds = np.linspace(0, count, pieces + 1).round().astype(int)
        return [(start + int(a), start + int(b)) for a, b in zip(bounds, bounds[1:])]

    if conv_groups == 1:
        return balanced(0, channels, math.ceil(channels / cap))
    per_group = channels // conv_groups
    if cap >= per_group:
        return [(a * per_group, b * per_group)
                for a, b in balanced(0, conv_groups, math.ceil(conv_groups / (cap // per_group)))]
    return [r for g in range(conv_groups) for r in balanced(g * per_group, per_group, math.ceil(per_group / cap))]


def _input_channels_for(graph: Graph, conv: Node, conv_groups: int, lo: int, hi: int, k: int,
                        new_nodes: list[Node]) -> tuple[Value, int]:
    """The input a piece [lo, hi) of a grouped Conv reads (a Slice over the channels of its groups,
    added to `new_nodes`) and the piece's own group count."""
    x = conv.inputs[0]
    per_group = conv.outputs[0].shape[1] // conv_groups
    first, last = lo // per_group, -(-hi // per_group)
    if first == 0 and last == conv_groups:
        return x, conv_groups
    in_per_group = x.shape[1] // conv_groups
    shape = list(x.shape)
    shape[1] = (last - first) * in_per_group
    sliced = Value(graph.fresh_name(f"{x.name}_groups{first}_{last}"), x.dtype, tuple(shape))
    spec = {"starts": first * in_per_group, "ends": last * in_per_group, "axes": 1}
    name = graph.fresh_name(f"{conv.name}_input{k}")
    if graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 21)) < 10:  # Slice-1: attributes
        new_nodes.append(Node("Slice", [x], [sliced], {key: [v] for key, v in spec.items()}, name,
                              attr_types={key: AttributeProto.INTS for key in spec}))
    else:
        bounds = [Value(graph.fresh_name(f"{conv.name}_slice{k}_{key}"), dtypes.INT64, (1,), np.array([v], np.int64))
                  for key, v in spec.items()]
        new_nodes.append(Node("Slice", [x, *bounds], [sliced], name=name))
    return sliced, last - first


def splittable(node: Node) -> bool:
    """Whether the node's output channels can be divided between slices (its weight's axis known)."""
    return _weight_axis(node) is not None


def _weight_axis(node: Node) -> int | None:
    entry = lookup(node.op_type, node.domain)
    if entry is None or entry.weight_input is None or entry.weight_axis is None or entry.output_axis is None:
        return None
    if len(node.inputs) <= entry.weight_input or node.inputs[entry.weight_input] is None:
        return None
    weight = node.inputs[entry.weight_input]
    if not weight.is_const or weight.const.ndim < 2 or len(node.outputs) != 1:
        return None
    if node.attrs.get("group", 1) != 1 and (node.op_type != "Conv" or not node.inputs[0].is_static):
        return None  # a grouped Conv splits only when its input channels can be sliced to match
    if entry.weight_axis(node) is None or entry.output_axis(node) is None:
        return None
    if not node.outputs[0].is_static:
        return None
    return entry.weight_axis(node) % weight.const.ndim


def _anchor_axes(node: Node, entry, channels: int, channel_axis: int) -> list[int | None]:
    axes: list[int | None] = []
    # an empty range names the inputs the op slices itself, without copying them
    by_op = entry.slice_channels(node, 0, 0)[0] if entry.slice_channels is not None else {}
    for i, v in enumerate(node.inputs):
        if i in by_op:
            axes.append(SLICED_BY_OP)
        elif i == entry.weight_input:
            axes.append(entry.weight_axis(node) % v.const.ndim)
        elif v is None or not v.is_const:
            axes.append(None)
        elif v.const.ndim == 1 and v.const.shape[0] == channels:
            axes.append(0)  # a bias vector over the output channels (Conv B, Gemm C)
        else:
            axis = _broadcast_axis(v, channels, channel_axis)
            if axis is False:
                raise CortexError(f"{node.describe()}: cannot split input {v.name!r} along the output channels")
            axes.append(axis)
    return axes


def epilogue_axes(node: Node, split: set[int], channels: int, channel_axis: int) -> list[int | None] | None:
    """How `node`'s inputs divide, when it can split with the nodes before it (`split`: ids of
    their results, each of the output's shape); None when it cannot."""
    out = node.outputs[0]
    if out.shape is None or len(out.shape) < -channel_axis or out.shape[channel_axis] != channels:
        return None
    if not any(v is not None and id(v) in split for v in node.inputs):
        return None
    axes: list[int | None] = []
    for v in node.inputs:
        if v is None or id(v) in split:
            axes.append(None)
        elif not v.is_const:
            return None
        else:
            axis = _broadcast_axis(v, channels, channel_axis)
            if axis is False:
                return None
            axes.append(axis)
    return axes


def _broadcast_axis(v: Value, channels: int, channel_axis: int):
    """The constant's axis aligned with the output channels (numpy broadcasting aligns from the
    right); None when it broadcasts along them; False when it does neither."""
    axis = v.const.ndim + channel_axis
    if axis < 0 or v.const.shape[axis] == 1:
        return None
    return axis if v.const.shape[axis] == channels else False


def slice_constant(graph: Graph, v: Value, axis: int, lo: int, hi: int, k: int) -> Value:
    part = np.ascontiguousarray(np.take(v.const, np.arange(lo, hi), axis=axis))
    return Value(graph.fresh_name(f"{v.name}_part{k}"), v.dtype, tuple(part.shape), part)
