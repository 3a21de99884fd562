"""Split large contractions into slices that run at the same time (`decompose --parallel N`).

A model without branches gives the threaded scheduler one ready CU at a time. Splitting each MatMul,
Gemm and Conv whose flops reach a threshold into N slices along its output channels, with the
mechanism `--max-cu-size` uses (`split_large_ops.split_unit`: the fused epilogue splits with it, a
Concat joins the slices), gives it N. The slices are balanced by flops: every output channel of a
contraction costs the same, so equal channel counts are equal work.

The partitioner keeps slice k of every split op apart from slice j != k and from unsliced work
(the slice index is part of an atom's kind), so the N slices of one op land in N different CUs,
all reading the same producer and all read by the join: the same dag.json level. Slices k of
sibling ops (an attention block's Q, K and V projections) may share a CU.
"""

from __future__ import annotations

from ir.graph import Graph, Node
from ir.ops import CONTRACTION, kind_of, lookup, node_flops
from passes.split_large_ops import fusion_units, split_unit, splittable


def split_for_parallel(graph: Graph, pieces: int, min_flops: int,
                       keep: set[int] = frozenset()) -> tuple[dict[int, int], int]:
    """Slice every contraction of at least `min_flops` flops into `pieces` (fewer where it has fewer
    output channels); the nodes in `keep` (ids: slices of --max-cu-size already) stay as they are.
    Returns the slice index of every node of a slice (id(node) -> index) and how many ops were sliced."""
    piece_of: dict[int, int] = {}
    if pieces < 2:
        return piece_of, 0
    replaced: dict[int, list[Node]] = {}
    for unit in fusion_units(graph):
        anchor = unit[0]
        if any(id(node) in keep for node in unit) or not _worth_slicing(anchor, pieces, min_flops):
            continue
        replaced[id(anchor)] = split_unit(graph, unit, pieces=pieces, piece_of=piece_of)
        for node in unit[1:]:
            replaced[id(node)] = []
    if not replaced:
        return piece_of, 0
    graph.nodes = [n for node in graph.nodes for n in replaced.get(id(node), [node])]
    graph.topologically_sort()
    return piece_of, sum(1 for nodes in replaced.values() if nodes)


def _worth_slicing(node: Node, pieces: int, min_flops: int) -> bool:
    if kind_of(node.op_type, node.domain) != CONTRACTION or not splittable(node):
        return False
    out = node.outputs[0]
    channels = out.shape[lookup(node.op_type, node.domain).output_axis(node) % len(out.shape)]
    return channels >= pieces and node_flops(node) >= min_flops
