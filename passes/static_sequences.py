"""Sequences of tensors whose elements are known at compile time become those tensors.

TorchScript exports of list code (`torch.split` into a list, `torch.cat` of a list, a loop that
appends to a list) carry ONNX sequence values: SequenceConstruct, SplitToSequence,
SequenceInsert... No backend holds a sequence, but once the number of elements is static (always
for SequenceConstruct; for SplitToSequence once its split, or its input's shape, is; for a Loop's
list once unroll_loops has copied the body per trip) each element is one tensor value, and the
readers become tensor ops: SequenceAt at a constant position an Identity, SequenceLength a
constant, ConcatFromSequence a Concat (of Unsqueezed elements with `new_axis`). This runs inside
shape inference's fixed-point loop, after the unrolling that exposes a loop's list; the sequence
producers no reader needs any more go with dead-code elimination. A sequence that another op, a
subgraph or the graph's outputs read stays a sequence.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ir.graph import Graph, Node, Value
from passes.base import rewrite_nodes

Elements = list[Value]


def resolve_static_sequences(graph: Graph) -> int:
    """Rewrite the readers of every sequence of `graph` (and of its subgraphs) whose elements are
    known; returns how many nodes were rewritten."""
    rewritten = sum(resolve_static_sequences(sub) for node in graph.nodes for sub in node.subgraphs)
    opset = _root(graph).opset_imports.get("", 21)
    known: dict[int, Elements] = {}
    return rewritten + rewrite_nodes(graph, lambda node: None if node.domain else _rewrite(graph, node, known, opset))


def _rewrite(graph: Graph, node: Node, known: dict[int, Elements], opset: int) -> list[Node] | None:
    """The nodes that replace `node`, or None to keep it. Producers record their elements in `known`
    and are kept (unread, dead-code elimination drops them); a SplitToSequence becomes a Split and a
    SequenceConstruct of its parts, the same sequence."""
    op, ins = node.op_type, node.inputs
    seq = known.get(id(ins[0])) if ins and ins[0] is not None else None
    if op == "SplitToSequence":
        made = _split(graph, node, opset)
        if made is not None:
            known[id(node.outputs[0])] = list(made[-1].inputs)
        return made
    if op == "SequenceEmpty":
        known[id(node.outputs[0])] = []
    elif op == "SequenceConstruct":
        known[id(node.outputs[0])] = list(ins)
    elif op == "Identity" and seq is not None:
        known[id(node.outputs[0])] = seq
    elif op == "SequenceInsert" and seq is not None:
        at = _position(node, 2, len(seq) + 1, default=len(seq))
        if at is not None:
            known[id(node.outputs[0])] = seq[:at] + [ins[1]] + seq[at:]
    elif op == "SequenceErase" and seq is not None and seq:
        at = _position(node, 1, len(seq), default=len(seq) - 1)
        if at is not None:
            known[id(node.outputs[0])] = seq[:at] + seq[at + 1:]
    elif op == "SequenceAt" and seq is not None and seq:
        at = _position(node, 1, len(seq), default=None)
        if at is not None:
            return [Node("Identity", [seq[at]], [node.outputs[0]], name=node.name)]
    elif op == "SequenceLength" and seq is not None:
        node.outputs[0].const = np.array(len(seq), np.int64)
        node.outputs[0].shape, node.outputs[0].producer = (), None
        return []
    elif op == "ConcatFromSequence" and seq is not None and seq:
        return _concat(graph, node, seq, opset)
    return None


def _position(node: Node, index: int, count: int, default: int | None) -> int | None:
    """A constant position input (negative counts from the end), `default` when absent; None when
    it is not a constant or is out of range."""
    value = node.inputs[index] if len(node.inputs) > index else None
    if value is None:
        return default
    if not value.is_const:
        return None
    at = int(np.asarray(value.const).reshape(-1)[0])
    at = at + count if at < 0 else at
    return at if 0 <= at < count else None


def _split(graph: Graph, node: Node, opset: int) -> list[Node] | None:
    x = node.inputs[0]
    split = node.inputs[1] if len(node.inputs) > 1 else None
    if x is None or not x.is_static or (split is not None and not split.is_const):
        return None
    rank = len(x.shape)
    axis = int(node.attrs.get("axis", 0)) % rank if rank else 0
    length = x.shape[axis]
    if split is None:
        sizes, squeeze = [1] * length, not node.attrs.get("keepdims", 1)
    else:
        given = np.asarray(split.const).astype(np.int64)
        if given.ndim == 0:    # one chunk size, the last chunk shorter
            step = int(given)
            sizes = [min(step, length - start) for start in range(0, length, step)] if step > 0 else []
        else:
            sizes = [int(s) for s in given]
        squeeze = False
    if not sizes or sum(sizes) != length:
        return None
    parts = [_value(graph, node, f"part{i}", x.dtype) for i in range(len(sizes))]
    made = [_op(graph, node, "Split", [x], parts, opset, axis=axis, split=sizes)]
    if squeeze:
        squeezed = [_value(graph, node, f"item{i}", x.dtype) for i in range(len(sizes))]
        made += [_op(graph, node, "Squeeze", [p], [s], opset, axes=[axis]) for p, s in zip(parts, squeezed)]
        parts = squeezed
    return [*made, Node("SequenceConstruct", parts, [node.outputs[0]], name=node.name)]


def _concat(graph: Graph, node: Node, seq: Elements, opset: int) -> list[Node]:
    axis = int(node.attrs.get("axis", 0))
    made, parts = [], list(seq)
    if node.attrs.get("new_axis", 0):
        parts = [_value(graph, node, f"item{i}", v.dtype) for i, v in enumerate(seq)]
        made = [_op(graph, node, "Unsqueeze", [v], [u], opset, axes=[axis]) for v, u in zip(seq, parts)]
    return [*made, Node("Concat", parts, [node.outputs[0]], {"axis": axis}, name=node.name)]


def _op(graph: Graph, node: Node, op: str, inputs: list[Value], outputs: list[Value], opset: int,
        axes: list[int] | None = None, split: list[int] | None = None, axis: int | None = None) -> Node:
    """Split or Squeeze/Unsqueeze in the model's opset: from 13 on, `split` and `axes` are inputs."""
    attrs: dict = {} if axis is None else {"axis": axis}
    listed = axes if axes is not None else split
    key = "axes" if axes is not None else "split"
    if opset >= 13:
        inputs = [*inputs, Value(graph.fresh_name(f"{node.name or op}_{key}"), TensorProto.INT64,
                                 (len(listed),), np.array(listed, np.int64))]
    else:
        attrs[key] = list(listed)
    return Node(op, inputs, outputs, attrs, name=graph.fresh_name(f"{node.name or op}_{op.lower()}"))


def _value(graph: Graph, node: Node, suffix: str, dtype: int) -> Value:
    return Value(graph.fresh_name(f"{node.outputs[0].name}_{suffix}"), dtype)


def _root(graph: Graph) -> Graph:
    while graph.parent is not None:
        graph = graph.parent
    return graph
