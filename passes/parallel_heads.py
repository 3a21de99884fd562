"""Slice an attention block by heads (`decompose --parallel N`): N groups of heads, each running its
heads from the Q, K and V projections to its rows of the output projection, the groups meeting once,
in a Sum, instead of in a Concat after each projection and not at all in between.

    q_k = x @ Wq[:, k] + bq[k] -> Reshape/Transpose -> [b, heads_k, s, d]     (k_k, v_k alike)
    p_k = Softmax(q_k @ k_k * scale + mask) -> p_k @ v_k -> Transpose/Reshape -> [b, s, heads_k * d]
    y_k = that @ Wo[k, :]                                    y = y_0 + ... + y_(N-1), then bias, residual

Exact: every head is computed as before, only the output projection's additions change order.

The block is found from its end, generically rather than by op names in a row: from the input of a
MatMul with a 2-D constant weight (the output projection), the walk goes back through the nodes that
can keep a split along one axis ("the head axis", which Reshapes and Transposes move): elementwise
ops (whose other inputs broadcast along it or are constants cut with it), Softmax over another axis,
MatMuls of two tensors split along a batch axis, and Reshapes that merge or split that axis with its
neighbour. It ends at MatMuls with a 2-D constant weight whose output columns are the split axis
(the Q, K and V projections: their weight columns are cut). What every slice reads whole (x, the
attention mask) is shared. The block is taken when it holds a MatMul of two computed tensors (else it
is a plain pair, `parallel_pairs.py`), every value inside it is read only inside it, and every split
axis divides by N; `parallel_slices.py` prices it like a pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ir.graph import Graph, Node, Value
from ir.ops import ELEMENTWISE, kind_of

SHARED = None   # an input every slice reads whole


@dataclass
class HeadBlock:
    """An attention block to slice: its `nodes`, the split axis of each value they make (and of its input),
    how each node's inputs divide (axis to cut, or SHARED), and the output projection's unit."""
    nodes: list[Node]
    axis_of: dict[int, int]
    cuts: dict[int, list[int | None]]
    projection: list[Node]                     # the output MatMul and its fused epilogue
    shared: list[Value] = field(default_factory=list)   # computed values every slice reads whole


def head_block(unit: list[Node], producers: dict[int, Node], readers: dict[int, list[Node]],
               outputs: set[int], members: dict[str, list[Node]], pieces: int, opset: int) -> HeadBlock | None:
    """The attention block ending in `unit`'s MatMul (the output projection), or None. `members`:
    the nodes of each fusion group; `opset`: the model's (Softmax's axis means more before 13)."""
    matmul = unit[0]
    if matmul.op_type != "MatMul" or len(matmul.inputs) != 2:
        return None
    x, weight = matmul.inputs
    if x.is_const or not weight.is_const or weight.const.ndim != 2 or not x.is_static:
        return None
    if weight.shape[0] % pieces or not matmul.outputs[0].is_static:
        return None
    axis_of: dict[int, int] = {id(x): len(x.shape) - 1}
    cuts: dict[int, list[int | None]] = {}
    found: dict[int, Node] = {}
    shared: dict[int, Value] = {}
    work = [x]
    while work:
        value = work.pop()
        node = producers.get(id(value))
        if node is None or len(node.outputs) != 1:
            return None
        if id(node) in found:
            continue
        axis = axis_of[id(value)]
        if value.shape[axis] % pieces:
            return None
        plan = _input_axes(node, axis, opset)
        if plan is None:
            return None
        found[id(node)] = node
        cuts[id(node)] = [a for a, _ in plan]
        for v, (a, follow) in zip(node.inputs, plan):
            if v is None or v.is_const:
                continue
            if not follow:
                shared[id(v)] = v
                continue
            if axis_of.setdefault(id(v), a) != a:
                return None              # one value split along two axes
            work.append(v)
    nodes = list(found.values())
    if not any(n.op_type == "MatMul" and not n.inputs[1].is_const for n in nodes):
        return None
    inside = {id(n) for n in nodes} | {id(matmul)}
    for node in nodes:
        out = node.outputs[0]
        if id(out) in outputs or any(id(r) not in inside for r in readers.get(id(out), [])):
            return None
        if not out.is_static:
            return None
    if any(id(v) in axis_of for v in shared.values()):
        return None                      # read whole by one node and split by another
    # A fusion group is cut by no slice: the block holds each of its groups whole.
    groups = {n.fusion_group for n in nodes if n.fusion_group is not None}
    if any(id(n) not in inside or n is matmul for g in groups for n in members[g]):
        return None
    return HeadBlock(nodes, axis_of, cuts, unit, list(shared.values()))


def _input_axes(node: Node, axis: int, opset: int) -> list[tuple[int | None, bool]] | None:
    """For each input of `node`, whose output is split along `axis`: (the input's axis to cut, or
    SHARED; whether the walk goes on into it). None: the node cannot keep the split."""
    out = node.outputs[0]
    rank = len(out.shape)
    if node.op_type == "MatMul" and len(node.inputs) == 2:
        a, b = node.inputs
        if b.is_const:
            # A projection: its weight's columns are the split axis; its input is read whole.
            if b.const.ndim != 2 or axis != rank - 1 or a.is_const:
                return None
            return [(SHARED, False), (1, False)]
        if a.is_const or axis >= rank - 2 or len(a.shape) != rank or len(b.shape) != rank:
            return None
        return [_aligned(v, axis, rank, out.shape[axis]) for v in (a, b)]
    if node.op_type == "Transpose":
        perm = node.attrs.get("perm") or list(reversed(range(rank)))
        return [(perm[axis], True)]
    if node.op_type == "Reshape":
        into = _reshaped_axis(node.inputs[0].shape, out.shape, axis)
        return None if into is None else [(into, True), (SHARED, False)]
    if node.op_type in ("Softmax", "LogSoftmax"):
        # Before opset 13 Softmax normalizes over every axis from `axis` on (default 1), since over it alone.
        over = node.attrs.get("axis", -1 if opset >= 13 else 1) % rank
        return None if axis == over or (opset < 13 and axis > over) else [(axis, True)]
    if kind_of(node.op_type, node.domain) == ELEMENTWISE:
        plan = [_aligned(v, axis, rank, out.shape[axis]) if v is not None else (SHARED, False)
                for v in node.inputs]
        return None if any(p is None for p in plan) else plan
    return None


def _aligned(v: Value, axis: int, rank: int, size: int) -> tuple[int | None, bool] | None:
    """How an input broadcast (from the right) into an output split along `axis` divides."""
    own = len(v.shape) - rank + axis
    if own < 0 or v.shape[own] == 1:
        return SHARED, False
    if v.shape[own] != size:
        return None
    return own, not v.is_const


def _reshaped_axis(shape_in, shape_out, axis: int) -> int | None:
    """The input axis of a Reshape that carries output `axis` when the Reshape only merges two
    neighbours into it, splits it into two (it the outer one), or leaves it be."""
    shape_in, shape_out = tuple(shape_in), tuple(shape_out)
    if shape_in == shape_out:
        return axis
    merged, split = (shape_out, shape_in) if len(shape_in) == len(shape_out) + 1 else (shape_in, shape_out)
    if len(split) != len(merged) + 1:
        return None
    # [.., H, d, ..] <-> [.., H * d, ..]: the head axis is the outer of the two
    if (split[:axis] == merged[:axis] and split[axis + 2:] == merged[axis + 1:]
            and split[axis] * split[axis + 1] == merged[axis]):
        return axis
    return None


def split_heads(graph: Graph, block: HeadBlock, pieces: int, piece_of: dict[int, int]) -> list[Node]:
    """The nodes replacing `block`'s nodes and its output projection: `pieces` slices, each ending in
    its partial product, then the Sum and the projection's epilogue."""
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    ordered = sorted(block.nodes, key=lambda n: position[id(n)])
    matmul = block.projection[0]
    x, weight = matmul.inputs
    rows = weight.shape[0] // pieces
    # Node by node, each in every slice: the partitioner grows CUs in this order, so the slices' CUs
    # alternate in dag.json's order and a walk in that order finds both chains ready side by side.
    pieces_of: list[dict[int, Value]] = [{} for _ in range(pieces)]
    new_nodes: list[Node] = []
    for node in ordered:
        for k, piece in enumerate(pieces_of):
            new_nodes.append(_slice_node(graph, block, node, piece, k, pieces))
            piece_of[id(new_nodes[-1])] = k
    out = matmul.outputs[0]
    partials = []
    for k, piece in enumerate(pieces_of):
        block_rows = Value(graph.fresh_name(f"{weight.name}_rows{k}"), weight.dtype, (rows, weight.shape[1]),
                           np.ascontiguousarray(weight.const[k * rows:(k + 1) * rows]))
        partial = Value(graph.fresh_name(f"{out.name}_partial{k}"), out.dtype, out.shape)
        part = Node("MatMul", [piece[id(x)], block_rows], [partial], name=graph.fresh_name(f"{matmul.name}_part{k}"))
        piece_of[id(part)] = k
        new_nodes.append(part)
        partials.append(partial)
    rest = block.projection[1:]
    if len(rest) == 1:
        rest[0].fusion_group = None   # what stays after the join is a group only if it is a chain of two
    total = Node("Sum", partials, [matmul.outputs[0]], name=graph.fresh_name(f"{matmul.name}_join"))
    return [*new_nodes, total, *rest]


def _slice_node(graph: Graph, block: HeadBlock, node: Node, piece: dict[int, Value], k: int, pieces: int) -> Node:
    """Slice k of `node`, reading slice k of what it reads inside the block (`piece`, which it extends)."""
    inputs = []
    for v, axis in zip(node.inputs, block.cuts[id(node)]):
        if v is not None and id(v) in piece:
            inputs.append(piece[id(v)])
        elif v is not None and v.is_const and axis is not None:
            inputs.append(_block_of(graph, v, axis, k, pieces))
        else:
            inputs.append(v)
    result = node.outputs[0]
    shape = list(result.shape)
    shape[block.axis_of[id(result)]] //= pieces
    sliced = Value(graph.fresh_name(f"{result.name}_heads{k}"), result.dtype, tuple(shape))
    piece[id(result)] = sliced
    if node.op_type == "Reshape":   # the slice's own static shape (the original may hold -1 or 0)
        inputs[1] = Value(graph.fresh_name(f"{node.name}_heads{k}_shape"), inputs[1].dtype, (len(shape),),
                          np.array(shape, np.int64))
    group = f"{node.fusion_group}/heads{k}" if node.fusion_group is not None else None
    return Node(node.op_type, inputs, [sliced], dict(node.attrs), graph.fresh_name(f"{node.name}_heads{k}"),
                node.domain, dict(node.attr_types), node.doc_string, group)


def _block_of(graph: Graph, v: Value, axis: int, k: int, pieces: int) -> Value:
    size = v.shape[axis] // pieces
    part = np.ascontiguousarray(np.take(v.const, np.arange(k * size, (k + 1) * size), axis=axis))
    return Value(graph.fresh_name(f"{v.name}_heads{k}"), v.dtype, tuple(part.shape), part)
