"""Split large contractions into slices that run at the same time (`decompose --parallel N`).

A model without branches gives the threaded scheduler one ready CU at a time. Splitting each MatMul,
Gemm and Conv worth it into N slices along its output channels, with the mechanism `--max-cu-size`
uses (`split_large_ops.split_unit`: the fused epilogue splits with it, a Concat joins the slices),
gives it N. The slices are balanced by flops: every output channel of a contraction costs the same,
so equal channel counts are equal work.

Which ops are worth it is a cost model in flops. Slicing an op of F flops into N saves F (N - 1) / N
on the critical path when the other threads are free, and costs, whether they are or not:
- about N more CUs (the slices, and the neighbours the slices no longer share a CU with), each a
  call into its module, a hand-off to a thread and the walk's decisions: `cu_overhead_flops`;
- copies: each slice after the first copies the op's input into its own memory, and the Concat's
  CU copies the slices in and writes the joined tensor (about twice the output), charged at
  `cu_overhead_flops / BYTES_PER_CU_OVERHEAD` a byte.
An op is sliced when the saving is at least `MARGIN` times the cost (the margin covers what the
model leaves out: the kernels slow down when both cores share the memory bus, and a hand-off's
wake-up takes longer on a busy machine), the most profitable first, and only while the model's
total slicing cost stays under `MAX_OVERHEAD_SHARE` of its flops (which binds only for N > 2,
since the margin already keeps one op's cost under a quarter of its flops at N = 2). So a model of
many small convolutions (shufflenet) keeps its CU count instead of tripling it. `cu_overhead_flops`
0 turns the model off (every contraction of at least `min_flops` is sliced).

Measured on the 2-core machine the bench runs on (wasmtime, light models): the `--parallel 2` build
on one thread costs 47-67 us more per extra CU than the default build (squeezenet, shufflenet,
MiniLM; the copies included), and the kernels run at about 25 GFLOP/s: 50 us is 1.25 M flops. A
host copy into a CU's memory, cold, costs about 0.1 ns a byte: one CU's overhead copies 500 KB.

Two MatMuls in a row slice as one pair (`parallel_pairs.py`), priced the same way with the Sum
that joins them: N CUs, and N partial results copied into the join instead of a Concat after each.
An attention block slices by heads (`parallel_heads.py`), priced like a pair over all its flops,
with the computed tensors every slice reads whole (its input, the mask) copied once per extra slice;
its blocks are found first, and their nodes are no candidates of their own.

A wide Conv slices along its output rows instead of its channels (`parallel_rows.py`, priced the
same): a channel slice would pack the im2col of the whole input again.

The partitioner keeps slice k of every split op apart from slice j != k and from unsliced work
(the slice index is part of an atom's kind), so the N slices of one op land in N different CUs,
all reading the same producer and all read by the join: the same dag.json level. Slices k of
sibling ops (an attention block's Q, K and V projections) may share a CU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ir.graph import Graph, Node
from ir.ops import CONTRACTION, kind_of, lookup, node_flops
from passes.parallel_heads import HeadBlock, head_block, split_heads
from passes.parallel_pairs import second_of_pair, split_pair
from passes.parallel_rows import continues_rows, rows_sliceable, split_rows
from passes.split_large_ops import fusion_units, split_unit, splittable

CU_OVERHEAD_FLOPS = 1_250_000     # one more CU, in flops of kernel time (50 us at 25 GFLOP/s)
BYTES_PER_CU_OVERHEAD = 500_000   # bytes copied in the time of one CU's overhead (0.1 ns a byte)
MAX_OVERHEAD_SHARE = 0.25         # the most slicing may add to a model's work, as a share of its flops
MARGIN = 2.0                      # how much more an op's slices must save than they cost


@dataclass
class SliceCandidate:
    unit: list[Node]
    saved: int           # flops off the critical path
    cost: float          # flops of overhead slicing adds
    second: list[Node] | None = None    # the MatMul sliced with it as a pair (parallel_pairs)
    block: HeadBlock | None = None      # the attention block `unit` ends, sliced by heads (parallel_heads)
    rows: bool = False                  # a Conv sliced along its output rows (parallel_rows)

    @property
    def gain(self) -> float:
        return self.saved - self.cost


def slicing_cost(anchor: Node, pieces: int, cu_overhead_flops: int, second: Node | None = None) -> tuple[int, float]:
    """(flops saved on the critical path, flops of overhead added) by cutting `anchor` in `pieces`
    (with `second`: that pair, joined by a Sum of `pieces` partial results)."""
    flops = node_flops(anchor) + (node_flops(second) if second is not None else 0)
    read = sum(v.nbytes for v in anchor.present_inputs if not v.is_const)
    written = anchor.outputs[0].nbytes if second is None else second.outputs[0].nbytes
    copied = (pieces - 1) * read + (2 if second is None else pieces + 1) * written
    return flops * (pieces - 1) // pieces, pieces * cu_overhead_flops + copied * cu_overhead_flops / BYTES_PER_CU_OVERHEAD


def split_for_parallel(graph: Graph, pieces: int, min_flops: int, keep: set[int] = frozenset(),
                       cu_overhead_flops: int = CU_OVERHEAD_FLOPS) -> tuple[dict[int, int], int]:
    """Slice the contractions of at least `min_flops` flops that the cost model finds worth it into
    `pieces` (fewer where an op has fewer output channels); the nodes in `keep` (ids: slices of
    --max-cu-size already) stay as they are. Returns the slice index of every node of a slice
    (id(node) -> index) and how many ops were sliced."""
    piece_of: dict[int, int] = {}
    if pieces < 2:
        return piece_of, 0
    replaced: dict[int, list[Node]] = {}
    row_parts: dict[int, list] = {}     # a row-sliced result (id) -> its row slices
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    for candidate in worth_slicing(graph, pieces, min_flops, keep, cu_overhead_flops):
        unit, second = candidate.unit, candidate.second
        if candidate.block is not None:
            block_nodes = sorted([*candidate.block.nodes, *unit], key=lambda n: position[id(n)])
            replaced[id(block_nodes[0])] = split_heads(graph, candidate.block, pieces, piece_of)
            for node in block_nodes[1:]:
                replaced[id(node)] = []
            continue
        pair = split_pair(graph, unit, second, pieces, piece_of) if second is not None else None
        if pair is not None:
            replaced[id(unit[0])], replaced[id(second[0])] = pair
            for node in [*unit[1:], *second[1:]]:
                replaced[id(node)] = []
            continue
        rows = candidate.rows or continues_rows(unit[0], pieces, row_parts)
        replaced[id(unit[0])] = (split_rows(graph, unit, pieces, piece_of, row_parts) if rows
                                 else split_unit(graph, unit, pieces=pieces, piece_of=piece_of))
        for node in unit[1:]:
            replaced[id(node)] = []
    if not replaced:
        return piece_of, 0
    graph.nodes = [n for node in graph.nodes for n in replaced.get(id(node), [node])]
    # A row-sliced result whose readers all read its slices needs no Concat.
    read = {id(v) for node in graph.nodes for v in node.present_inputs} | {id(v) for v in graph.outputs}
    graph.nodes = [n for n in graph.nodes if not (n.op_type == "Concat" and id(n.outputs[0]) in row_parts
                                                  and id(n.outputs[0]) not in read)]
    graph.topologically_sort()
    return piece_of, sum(1 for nodes in replaced.values() if nodes)


def worth_slicing(graph: Graph, pieces: int, min_flops: int, keep: set[int] = frozenset(),
                  cu_overhead_flops: int = CU_OVERHEAD_FLOPS) -> list[SliceCandidate]:
    """The fusion units to slice, in graph order."""
    units = fusion_units(graph)
    anchors = {id(unit[0]): unit for unit in units}
    readers: dict[int, list[Node]] = {}
    for node in graph.nodes:
        for v in node.present_inputs:
            readers.setdefault(id(v), []).append(node)
    outputs = {id(v) for v in graph.outputs}
    candidates, taken = head_candidates(graph, units, readers, outputs, pieces, min_flops, keep, cu_overhead_flops)
    for unit in units:
        anchor = unit[0]
        if id(anchor) in taken or any(id(node) in keep for node in unit) or not _sliceable(anchor, pieces, min_flops):
            continue
        second = second_of_pair(unit, readers, outputs, anchors)
        if second is not None and not any(id(node) in keep or id(node) in taken for node in second):
            saved, cost = slicing_cost(anchor, pieces, cu_overhead_flops, second[0])
            if cu_overhead_flops == 0 or saved >= MARGIN * cost:
                candidates.append(SliceCandidate(unit, saved, cost if cu_overhead_flops else 0.0, second))
                taken.add(id(second[0]))
                continue
        saved, cost = slicing_cost(anchor, pieces, cu_overhead_flops)
        if cu_overhead_flops == 0 or saved >= MARGIN * cost:
            candidates.append(SliceCandidate(unit, saved, cost if cu_overhead_flops else 0.0,
                                             rows=rows_sliceable(anchor, pieces)))
    budget = MAX_OVERHEAD_SHARE * sum(node_flops(n) for n in graph.nodes)
    chosen: set[int] = set()
    for c in sorted(candidates, key=lambda c: -c.gain):
        if cu_overhead_flops and c.cost > budget:
            continue
        budget -= c.cost
        chosen.add(id(c.unit[0]))
    return [c for c in candidates if id(c.unit[0]) in chosen]


def head_candidates(graph: Graph, units: list[list[Node]], readers: dict[int, list[Node]], outputs: set[int],
                    pieces: int, min_flops: int, keep: set[int],
                    cu_overhead_flops: int) -> tuple[list[SliceCandidate], set[int]]:
    """The attention blocks of at least `min_flops` worth slicing by heads, and the ids of every node
    they hold (whose units are then no candidates of their own)."""
    producers = {id(v): node for node in graph.nodes for v in node.outputs}
    members: dict[str, list[Node]] = {}
    for node in graph.nodes:
        if node.fusion_group is not None:
            members.setdefault(node.fusion_group, []).append(node)
    opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 21))
    candidates, taken = [], set()
    for unit in units:
        if unit[0].op_type != "MatMul" or any(id(node) in keep for node in unit):
            continue
        block = head_block(unit, producers, readers, outputs, members, pieces, opset)
        if block is None or any(id(node) in keep or id(node) in taken for node in block.nodes):
            continue
        flops = sum(node_flops(n) for n in block.nodes) + node_flops(unit[0])
        read = sum(v.nbytes for v in block.shared)
        copied = (pieces - 1) * read + (pieces + 1) * unit[0].outputs[0].nbytes
        cost = pieces * cu_overhead_flops + copied * cu_overhead_flops / BYTES_PER_CU_OVERHEAD
        saved = flops * (pieces - 1) // pieces
        if flops >= min_flops and (cu_overhead_flops == 0 or saved >= MARGIN * cost):
            candidates.append(SliceCandidate(unit, saved, cost, block=block))
            taken.update(id(node) for node in [*block.nodes, *unit])
    return candidates, taken


def _sliceable(node: Node, pieces: int, min_flops: int) -> bool:
    if kind_of(node.op_type, node.domain) != CONTRACTION or not splittable(node):
        return False
    out = node.outputs[0]
    channels = out.shape[lookup(node.op_type, node.domain).output_axis(node) % len(out.shape)]
    return channels >= pieces and node_flops(node) >= min_flops
