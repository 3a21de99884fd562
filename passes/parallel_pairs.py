"""Slice two MatMuls in a row as one (`decompose --parallel N`): the first along its output columns,
the second along the rows of its weight, so each slice carries on to the next product and the
slices meet once, in a Sum, instead of in a Concat after each op.

    x @ W1 -> epilogue -> h @ W2 = y     (a transformer's feed-forward: W1 up, GELU, W2 down)
    slice k: x @ W1[:, k] -> epilogue -> h_k @ W2[k, :] = y_k       y = y_0 + ... + y_(N-1)

Exact when the epilogue works column by column (bias, GELU: `split_unit` splits only such an
epilogue) since h @ W2 is the sum over row blocks of W2; only the order of the additions changes.
The second MatMul's own epilogue (its bias, a residual Add) stays after the Sum. The pair is taken
when the first MatMul's output, once its epilogue has run, is read by the second alone.
"""

from __future__ import annotations

import numpy as np

from ir.graph import Graph, Node, Value
from passes.split_large_ops import split_unit


def second_of_pair(unit: list[Node], readers: dict[int, list[Node]], outputs: set[int],
                   anchors: dict[int, list[Node]]) -> list[Node] | None:
    """The unit whose MatMul is the only reader of `unit`'s result, when both can slice as a pair."""
    first, result = unit[0], unit[-1].outputs[0]
    if first.op_type != "MatMul" or id(result) in outputs or len(readers.get(id(result), [])) != 1:
        return None
    second = readers[id(result)][0]
    if second.op_type != "MatMul" or second.inputs[0] is not result or id(second) not in anchors:
        return None
    weight = second.inputs[1]
    if not weight.is_const or weight.const.ndim != 2 or not result.is_static or not second.outputs[0].is_static:
        return None
    return anchors[id(second)]


def split_pair(graph: Graph, first: list[Node], second: list[Node], pieces: int,
               piece_of: dict[int, int]) -> tuple[list[Node], list[Node]] | None:
    """The nodes replacing `first` and `second` (the slices, then the Sum and `second`'s epilogue),
    or None when `first`'s epilogue does not all split with it."""
    nodes = split_unit(graph, first, pieces=pieces, piece_of=piece_of)
    join = nodes[-1]
    if join.op_type != "Concat" or join.outputs[0] is not first[-1].outputs[0]:
        for node in nodes:
            piece_of.pop(id(node), None)
        return None
    matmul, weight = second[0], second[0].inputs[1]
    partials, lo = [], 0
    tail: list[Node] = []
    for k, piece in enumerate(join.inputs):
        hi = lo + piece.shape[-1]
        rows = Value(graph.fresh_name(f"{weight.name}_rows{k}"), weight.dtype, (hi - lo, weight.shape[1]),
                     np.ascontiguousarray(weight.const[lo:hi]))
        out = matmul.outputs[0]
        partial = Value(graph.fresh_name(f"{out.name}_partial{k}"), out.dtype, out.shape)
        node = Node("MatMul", [piece, rows], [partial], name=graph.fresh_name(f"{matmul.name}_part{k}"))
        piece_of[id(node)] = k
        tail.append(node)
        partials.append(partial)
        lo = hi
    rest = second[1:]
    if len(rest) == 1:
        rest[0].fusion_group = None   # what stays after the join is a group only if it is a chain of two
    total = Node("Sum", partials, [matmul.outputs[0]], name=graph.fresh_name(f"{matmul.name}_join"))
    return nodes[:-1] + tail, [total, *rest]
