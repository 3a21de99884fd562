"""Partition an optimised graph into computation units (CUs).

A CU is a convex set of nodes (no path leaves it and comes back), so CUs form a DAG. Fusion groups
are atoms: they are never cut and count as one op of depth. Limits: a CU owns at most
`max_cu_size` parameters (too-large ops are split first, see `split_large_ops`), its longest op
path is at most `max_cu_depth` atoms, and CUs under `min_cu_size` parameters are merged into a
neighbour where that keeps the limits and convexity. An op that cannot be divided by its nature
(one direction's recurrence, whose every step reads the whole state) and alone exceeds
`max_cu_size` is a CU of its own, the reason in `CU.over_limit`: the limit then still bounds every
CU but those, and no default limit makes an ordinary model (a hidden-512 OCR LSTM) fail.

How the atoms (fusion groups and lone nodes, `cu_atoms.py`) are grouped, greedily and then by
merges, near-linearly on large graphs: `cu_grouping.py`.

Kinds of work that never share a CU: each atom has a kind, and atoms join and merge only with CUs of
their kind. The kinds:
- fallback (`--fallback onnxruntime`): nodes no target can lower (decompose hands the pass that
  rule, `codegen.lower.unsupported_nodes`, as `cannot_lower`) run on that runtime;
- branch (`branch_cus.py`): the nodes of one branch of a large If run only when its condition has
  that branch's value;
- repeating (`--cache-inputs`, `cache_inputs.py`): work that depends only on the inputs named
  there (and constants) stays apart from work that reads the inputs that change, so that the
  result cache can hit;
- slice k (`--parallel N`, `parallel_slices.py`): the N slices of one large contraction go to N
  different CUs, so that they can run at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ir.errors import CortexError
from ir.graph import Graph, Node, Value
from ir.options import option, option_fields
from passes.base import Pass
from passes.branch_cus import Branches, Select, hoist_large_ifs
from passes.cache_inputs import check_names, cut_mixed_groups, parse_names, repeating_nodes, show_names
from passes.cu_atoms import build_atoms
from passes.cu_grouping import ROUNDS, group_atoms
from passes.parallel_slices import CU_OVERHEAD_FLOPS, split_for_parallel
from passes.split_large_ops import split_large_ops

REPEATING_MARK = "repeating"      # the manifest's `cache` mark of such a CU
FALLBACKS = ("onnxruntime",)    # runtimes that run a CU's cu.onnx as it is


@dataclass
class CU:
    """One computation unit: its nodes in topological order and what the limits measure."""
    nodes: list[Node]
    params: int
    depth: int
    small_reason: str | None = None   # why it stayed under --min-cu-size, when it did
    runs_on: str | None = None        # the fallback runtime for a CU of nodes no target lowers
    over_limit: str | None = None     # why it holds more than --max-cu-size (an indivisible op alone)
    activation: tuple[str, bool] | None = None   # (condition, value) of a branch CU
    cache: str | None = None          # REPEATING_MARK: depends only on --cache-inputs


@dataclass
class Partition:
    cus: list[CU]                      # in a topological order of the CU graph
    split_ops: int = 0                 # ops split along output channels to respect --max-cu-size
    sliced_ops: int = 0                # ops sliced for --parallel
    selects: list[Select] = field(default_factory=list)   # the outputs of hoisted Ifs, no CU's

    def cu_of(self) -> dict[int, int]:
        return {id(n): i for i, cu in enumerate(self.cus) for n in cu.nodes}


@dataclass(frozen=True)
class PartitionIntoCUs(Pass):
    name = "partition-into-cus"
    min_cu_size: int = field(default=256, metadata=option(
        "Merge CUs with fewer parameters into a neighbour where the limits allow."))
    max_cu_size: int | None = field(default=1_000_000, metadata=option(
        "Most parameters a CU may own; larger ops are split along output channels."))
    max_cu_depth: int = field(default=3, metadata=option(
        "Most ops on a path inside a CU (a fusion group counts as one)."))
    fallback: str | None = field(default=None, metadata=option(
        "Put nodes that no target can lower into CUs of their own that run on this runtime "
        "(their cu.onnx is the artifact); without it, compile-<target> refuses such models.",
        choices=FALLBACKS))
    cache_inputs: tuple[str, ...] = field(default=(), metadata=option(
        "Model inputs whose values repeat between calls (comma-separated): work that depends only on "
        "them stays in CUs of its own, marked for the result cache.", parse=parse_names, show=show_names))
    parallel: int = field(default=1, metadata=option(
        "Split the MatMuls, Gemms and Convs of at least --parallel-min-flops into this many slices along "
        "their output channels (MatMul pairs and attention blocks by columns and heads, meeting once in a "
        "Sum), each in a CU of its own, where the cost model says it pays, so that this many threads have "
        "work (1: off)."))
    parallel_min_flops: int = field(default=4_000_000, metadata=option(
        "With --parallel: the smallest contraction, in flops, worth slicing (smaller ones cost more in "
        "per-CU overhead than a thread saves)."))
    parallel_cu_overhead_flops: int = field(default=CU_OVERHEAD_FLOPS, metadata=option(
        "With --parallel: what one more CU costs, in flops of kernel time; an op is sliced only when "
        "the slices save more than the CUs and copies they add (0: slice every op over --parallel-min-flops)."))
    # The rule saying which nodes need the fallback (codegen's `unsupported_nodes`, which this
    # layer may not import); decompose sets it with `fallback`.
    cannot_lower: Callable[[Graph], list[Node]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        check_limits(self.min_cu_size, self.max_cu_size, self.max_cu_depth)
        if self.parallel < 1:
            raise CortexError(f"--parallel must be at least 1 (got {self.parallel})")
        if self.parallel_min_flops < 0:
            raise CortexError(f"--parallel-min-flops must not be negative (got {self.parallel_min_flops})")
        if self.parallel_cu_overhead_flops < 0:
            raise CortexError("--parallel-cu-overhead-flops must not be negative "
                              f"(got {self.parallel_cu_overhead_flops})")

    def limits(self) -> dict:
        """The options as manifest.json records them (`fallback` only when given)."""
        given = {"fallback": self.fallback is not None, "cache_inputs": bool(self.cache_inputs),
                 "parallel": self.parallel > 1, "parallel_min_flops": self.parallel > 1,
                 "parallel_cu_overhead_flops": self.parallel > 1}
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f, _ in option_fields(type(self)) if given.get(f.name, True)}

    def run(self, graph: Graph) -> Partition:
        """The partition of `graph` into CUs. The graph is rewritten in place first: large Ifs
        hoisted, too-large ops split, contractions sliced for --parallel, constant outputs given
        an Identity; the partition's nodes are that graph's."""
        check_names(graph, self.cache_inputs)
        materialize_constant_outputs(graph)
        oversized: dict[int, str] = {}

        def split(g: Graph) -> int:
            return split_large_ops(g, self.max_cu_size, oversized) if self.max_cu_size is not None else 0
        # A hoisted branch's too-large ops are split inside it, so their pieces carry its activation.
        branches = hoist_large_ifs(graph, self.min_cu_size, split)
        before = {id(n) for n in graph.nodes}
        split_ops = branches.split_ops + split(graph)
        # Slices of --max-cu-size are CUs of their own already; the other large contractions are sliced.
        slices, sliced = split_for_parallel(graph, self.parallel, self.parallel_min_flops,
                                            {id(n) for n in graph.nodes if id(n) not in before},
                                            self.parallel_cu_overhead_flops)
        fallback = set()
        if self.fallback is not None:
            if self.cannot_lower is None:
                raise AssertionError("--fallback needs the rule saying which nodes no target lowers")
            fallback = {id(n) for n in self.cannot_lower(graph)}
        graph.topologically_sort()
        repeating = repeating_nodes(graph, self.cache_inputs) if self.cache_inputs else None
        if repeating is not None:
            cut_mixed_groups(graph, repeating)
        part = partition_graph(graph, self.min_cu_size, self.max_cu_size, self.max_cu_depth,
                               fallback, self.fallback, oversized, branches, repeating, slices)
        return replace(part, split_ops=split_ops, sliced_ops=sliced)


def check_limits(min_cu_size: int, max_cu_size: int | None, max_cu_depth: int) -> None:
    if max_cu_depth < 1:
        raise CortexError(f"--max-cu-depth must be at least 1 (got {max_cu_depth})")
    if min_cu_size < 0:
        raise CortexError(f"--min-cu-size must not be negative (got {min_cu_size})")
    if max_cu_size is not None and max_cu_size < 1:
        raise CortexError(f"--max-cu-size must be at least 1 (got {max_cu_size})")
    if max_cu_size is not None and min_cu_size > max_cu_size:
        raise CortexError(f"--min-cu-size {min_cu_size} is larger than --max-cu-size {max_cu_size}")


def materialize_constant_outputs(graph: Graph) -> None:
    """A model output that is a constant gets an Identity node, so some CU produces it."""
    for i, v in enumerate(graph.outputs):
        if not v.is_const:
            continue
        source = Value(graph.fresh_name(f"{v.name}_value"), v.dtype, v.shape, v.const)
        v.const = None
        graph.nodes.append(Node("Identity", [source], [v], name=graph.fresh_name(f"{v.name}_identity")))


def partition_graph(graph: Graph, min_cu_size: int, max_cu_size: int | None, max_cu_depth: int,
                    fallback_nodes: set[int] = frozenset(), fallback: str | None = None,
                    oversized: dict[int, str] | None = None, branches: Branches | None = None,
                    repeating: set[int] | None = None, slices: dict[int, int] | None = None) -> Partition:
    """Assign every node but the Selects of hoisted Ifs to exactly one CU (see the module doc for
    how). The limits are the fields of a `PartitionIntoCUs`, which checked them; `fallback_nodes`
    (ids) go into CUs that run on `fallback`; `oversized` (id(node) -> why) are the ops that may
    exceed max_cu_size, each alone in its CU (`split_large_ops` names them); `branches` are the
    hoisted Ifs (`branch_cus`), `repeating` the ids of nodes on --cache-inputs alone, `slices` the
    slice index of each node of a --parallel slice (`parallel_slices`)."""
    graph.topologically_sort()
    atoms = build_atoms(graph, fallback_nodes, branches, repeating, slices)
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    cus = []
    for record in group_atoms(atoms, min_cu_size, max_cu_size, max_cu_depth, oversized):
        fallback_kind, activation, repeating_kind, _ = record.kind
        nodes = sorted((n for a in record.atoms for n in atoms.nodes[a]), key=lambda n: position[id(n)])
        small_reason = (record.merge_refused or ROUNDS) if record.params < min_cu_size else None
        cus.append(CU(nodes, record.params, record.depth, small_reason, fallback if fallback_kind else None,
                      record.over_limit, activation, REPEATING_MARK if repeating_kind else None))
    return Partition(cus, selects=list(branches.selects) if branches else [])
