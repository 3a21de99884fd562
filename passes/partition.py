"""Partition an optimised graph into computation units (CUs).

A CU is a convex set of nodes (no path leaves it and comes back), so CUs form a DAG. Fusion groups
are atoms: they are never cut and count as one op of depth. Limits: a CU owns at most
`max_cu_size` parameters (too-large ops are split first, see `split_large_ops`), its longest op
path is at most `max_cu_depth` atoms, and CUs under `min_cu_size` parameters are merged into a
neighbour where that keeps the limits and convexity. An op that cannot be divided by its nature
(one direction's recurrence, whose every step reads the whole state) and alone exceeds
`max_cu_size` is a CU of its own, the reason in `CU.over_limit`: the limit then still bounds every
CU but those, and no default limit makes an ordinary model (a hidden-512 OCR LSTM) fail.

How it stays near-linear on large graphs:
1. Greedy, in topological order of atoms: an atom joins the CU of its most recently created
   producer CU, if depth and size allow, otherwise starts a new CU. Joining the newest producer CU
   keeps "creation order is a topological order of the CU graph", and under that invariant the
   join is always convex: no other producer CU can be downstream of the newest one.
2. Merges of neighbouring CUs, then of siblings reading the same tensor (small CUs first): a merge
   of X and Y (X earlier in the order) is convex when no path from X reaches Y other than a direct
   edge; the search for one only visits CUs that lie between X and Y in the current topological
   order, and the same search yields the reordering that keeps the order topological.

Kinds of work that never share a CU: each atom has a kind, and atoms join and merge only with CUs of
their kind. Both phases keep their convexity arguments: a join that is refused starts a new CU,
and a merge is still checked. The kinds:
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

from dataclasses import dataclass, field
from typing import Callable

from ir.errors import CortexError
from ir.graph import Graph, Node, Value
from ir.options import option, option_fields
from passes.base import Pass
from passes.branch_cus import Branches, Select, hoist_large_ifs
from passes.cache_inputs import check_names, cut_mixed_groups, parse_names, repeating_nodes, show_names
from passes.cu_atoms import Atoms, atom_order, build_atoms
from passes.parallel_slices import CU_OVERHEAD_FLOPS, split_for_parallel
from passes.split_large_ops import split_large_ops

DEPTH = "merging would exceed --max-cu-depth"
SIZE = "merging would exceed --max-cu-size"
CONVEXITY = "merging would break convexity (a path leaves and re-enters)"
ALONE = "no neighbouring CU"
ROUNDS = "the merge rounds ran out"
FALLBACK = "a fallback CU merges only with fallback CUs"
BRANCH = "a branch CU merges only with CUs of the same branch"
REPEATING = "work on --cache-inputs alone merges only with such work"
SLICE = "a --parallel slice merges only with slices of the same index"
REPEATING_MARK = "repeating"      # the manifest's `cache` mark of such a CU
FALLBACKS = ("onnxruntime",)    # runtimes that run a CU's cu.onnx as it is
MAX_SIBLINGS = 8  # siblings tried per CU, and the widest fan-out searched for them: they bound
MAX_FAN = 64      # the merge phase's cost on very wide graphs


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


@dataclass
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
    result: Partition | None = field(default=None, repr=False, compare=False)

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

    def run(self, graph: Graph) -> Graph:
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
        self.result = partition_graph(graph, self.min_cu_size, self.max_cu_size, self.max_cu_depth,
                                      fallback, self.fallback, oversized, branches, repeating, slices)
        self.result.split_ops = split_ops
        self.result.sliced_ops = sliced
        return graph


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


# -- the partitioner ------------------------------------------------------------------------------
class _Partitioner:
    def __init__(self, atoms: Atoms, min_size: int, max_size: int | None, max_depth: int,
                 fallback: str | None = None, oversized: dict[int, str] | None = None):
        self.atoms, self.min_size, self.max_depth = atoms, min_size, max_depth
        self.fallback = fallback
        self.oversized = oversized or {}                # id(node) -> why it cannot be divided
        self.max_size = max_size if max_size is not None else float("inf")
        self.rank = [0] * len(atoms.nodes)          # atom -> position in topological order
        self.cu_of: list[int] = [-1] * len(atoms.nodes)
        self.depth_in_cu: list[int] = [0] * len(atoms.nodes)
        self.members: dict[int, list[int]] = {}     # CU -> atoms
        self.consts: dict[int, dict[int, int]] = {}   # CU -> {id(const): elements}
        self.total: dict[int, int] = {}               # CU -> parameters (the sum of its consts)
        self.depth: dict[int, int] = {}
        self.preds: dict[int, set[int]] = {}
        self.succs: dict[int, set[int]] = {}
        self.order: list[int | None] = []           # CUs in topological order (None: merged away)
        self.pos: dict[int, int] = {}
        self.reasons: dict[int, str] = {}           # CU -> why its last merge attempt failed
        self.inputs_of: dict[int, set[int]] = {}    # CU -> model inputs it reads
        self.input_readers: dict[int, set[int]] = {}  # model input -> CUs reading it
        self.latest_reader: dict[int, int] = {}     # model input -> newest CU reading it (greedy phase)
        self.kind: dict[int, tuple] = {}            # CU -> the kind of its atoms
        self.over_limit: dict[int, str] = {}        # CU -> why it holds more than max_size

    # greedy phase
    def grow(self) -> None:
        order = atom_order(self.atoms)
        for r, a in enumerate(order):
            self.rank[a] = r
        for a in order:
            size = sum(self.atoms.consts[a].values())
            reasons = [self.oversized[id(n)] for n in self.atoms.nodes[a] if id(n) in self.oversized]
            if size > self.max_size and not reasons:
                node = self.atoms.nodes[a][0]
                raise CortexError(f"{node.describe()} holds {size:,} parameters, more than --max-cu-size "
                                  f"{int(self.max_size):,}, and cannot be split; raise --max-cu-size")
            pred_cus = {self.cu_of[p] for p in self.atoms.preds[a]}
            if size > self.max_size:
                # Alone in a CU of its own: every join and merge then fails the size check, so
                # the excess stays this one op's, and the manifest says why.
                self.over_limit[self._new_cu(a, pred_cus)] = "; ".join(reasons)
                continue
            target = max(pred_cus, key=self.pos.__getitem__) if pred_cus else None
            kind = self.atoms.kinds[a]
            if target is not None:
                d = 1 + max(self.depth_in_cu[p] for p in self.atoms.preds[a] if self.cu_of[p] == target)
                if self.kind[target] == kind and d <= self.max_depth \
                        and self._params_with(target, self.atoms.consts[a]) <= self.max_size:
                    self._add(target, a, d)
                    for p in pred_cus - {target}:
                        self._link(p, target)
                    continue
            else:
                # An atom fed only by model inputs joins the newest CU reading one of them: it has
                # no producer, so no path can enter it and the join is convex wherever it goes.
                readers = [self.latest_reader[v] for v in self.atoms.model_inputs[a]
                           if v in self.latest_reader and self.kind[self.latest_reader[v]] == kind]
                reader = max(readers, key=self.pos.__getitem__, default=None)
                if reader is not None and self._params_with(reader, self.atoms.consts[a]) <= self.max_size:
                    self._add(reader, a, 1)
                    continue
            self._new_cu(a, pred_cus)

    def _new_cu(self, a: int, pred_cus: set[int]) -> int:
        """A new CU, last in the order, holding atom `a`, which reads `pred_cus`."""
        cu = len(self.order)
        self.members[cu], self.consts[cu], self.total[cu], self.depth[cu] = [], {}, 0, 0
        self.preds[cu], self.succs[cu], self.inputs_of[cu] = set(), set(), set()
        self.kind[cu] = self.atoms.kinds[a]
        self.pos[cu] = len(self.order)
        self.order.append(cu)
        self._add(cu, a, 1)
        for p in pred_cus:
            self._link(p, cu)
        return cu

    def _add(self, cu: int, a: int, depth: int) -> None:
        self.cu_of[a] = cu
        self.depth_in_cu[a] = depth
        self.members[cu].append(a)
        self.total[cu] = self._params_with(cu, self.atoms.consts[a])
        self.consts[cu].update(self.atoms.consts[a])
        self.depth[cu] = max(self.depth[cu], depth)
        for v in self.atoms.model_inputs[a]:
            self.inputs_of[cu].add(v)
            self.input_readers.setdefault(v, set()).add(cu)
            if v not in self.latest_reader or self.pos[cu] > self.pos[self.latest_reader[v]]:
                self.latest_reader[v] = cu

    def _link(self, src: int, dst: int) -> None:
        self.succs[src].add(dst)
        self.preds[dst].add(src)

    def _params_with(self, cu: int, extra: dict[int, int]) -> int:
        mine = self.consts[cu]
        return self.total[cu] + sum(n for k, n in extra.items() if k not in mine)

    def params(self, cu: int) -> int:
        return self.total[cu]

    # merge phase
    def merge_neighbours(self, rounds: int = 8) -> None:
        # Each round tries every CU once; a merge can enable another, so repeat while any happened
        # (two or three rounds in practice; the cap bounds the cost).
        for _ in range(rounds):
            merged = False
            alive = sorted(self.members, key=lambda c: (self.params(c) >= self.min_size, self.params(c), self.pos[c]))
            for cu in alive:
                if cu in self.members and self._merge_best_neighbour(cu):
                    merged = True
            if not merged:
                break

    def _candidates(self, cu: int) -> list[tuple[int, int]]:
        """(rank, CU) to try merging with: neighbours first (a merge removes the tensors between
        them), then siblings that read the same producer's or model input's tensors (the shared
        tensor then crosses one border fewer), nearest in the order first."""
        neighbours = self.preds[cu] | self.succs[cu]
        siblings: set[int] = set()
        for group in [*(self.succs[p] for p in self.preds[cu]), *(self.preds[s] for s in self.succs[cu]),
                      *(self.input_readers[v] for v in self.inputs_of[cu])]:
            if len(group) <= MAX_FAN:  # a tensor read by thousands of CUs would make this quadratic
                siblings |= group
        siblings -= neighbours | {cu}
        near = sorted(siblings, key=lambda c: (abs(self.pos[c] - self.pos[cu]), self.pos[c]))[:MAX_SIBLINGS]
        return [(0, c) for c in sorted(neighbours, key=self.pos.__getitem__)] + [(1, c) for c in near]

    def _merge_best_neighbour(self, cu: int) -> bool:
        best = None
        reasons = set()
        for rank, other in self._candidates(cu):
            x, y = sorted((cu, other), key=self.pos.__getitem__)
            outcome = self._try(x, y)
            if isinstance(outcome, str):
                reasons.add(outcome)
                continue
            depths, between = outcome
            # Among allowed merges, the one giving the smallest CU keeps CU sizes even.
            key = (rank, self._params_with(x, self.consts[y]))
            if best is None or key < best[0]:
                best = (key, x, y, depths, between)
        if best is None:
            self.reasons[cu] = "; ".join(sorted(reasons)) or ALONE
            return False
        _, x, y, depths, between = best
        self._merge(x, y, depths, between)
        return True

    def _try(self, x: int, y: int):
        """Merge X into Y (X earlier in the order)? Returns why not, or the new atom depths and the
        CUs that lie between them in the order and are reachable from X (moved after the merged CU)."""
        if self.kind[x] != self.kind[y]:
            return next(why for why, mine, theirs in zip((FALLBACK, BRANCH, REPEATING, SLICE), self.kind[x], self.kind[y])
                        if mine != theirs)
        if self._params_with(x, self.consts[y]) > self.max_size:
            return SIZE
        depths = self._merged_depths(self.members[x] + self.members[y])
        if max(depths.values()) > self.max_depth:
            return DEPTH
        reachable = self._reachable_between(x, y)
        if reachable is None:
            return CONVEXITY
        return depths, reachable

    def _merged_depths(self, atoms: list[int]) -> dict[int, int]:
        inside = set(atoms)
        depths: dict[int, int] = {}
        for a in sorted(atoms, key=self.rank.__getitem__):
            depths[a] = 1 + max((depths[p] for p in self.atoms.preds[a] if p in inside), default=0)
        return depths

    def _reachable_between(self, x: int, y: int) -> list[int] | None:
        """CUs reachable from X through something other than Y, limited to those ordered before Y;
        None if Y is among them (X -> Z -> Y: merging would make a cycle)."""
        limit = self.pos[y]
        seen: set[int] = set()
        stack = [s for s in self.succs[x] if s != y]
        while stack:
            c = stack.pop()
            if c in seen or self.pos[c] > limit:
                continue
            if c == y:
                return None
            seen.add(c)
            stack.extend(self.succs[c])
        return sorted(seen, key=self.pos.__getitem__)

    def _merge(self, x: int, y: int, depths: dict[int, int], between: list[int]) -> None:
        """Fold X into Y. Y takes the place after every CU between them that X does not reach, and
        the ones X reaches move after Y: the order stays topological."""
        lo, hi = self.pos[x], self.pos[y]
        moved = set(between)
        span = hi + 1 - lo
        window = [c for c in self.order[lo:hi + 1] if c is not None and c not in moved and c not in (x, y)]
        new_window = [None] * (span - len(window) - 1 - len(between)) + window + [y] + between
        self.order[lo:hi + 1] = new_window
        for i, c in enumerate(new_window, start=lo):
            if c is not None:
                self.pos[c] = i
        for a in self.members[x]:
            self.cu_of[a] = y
        self.members[y] = sorted(self.members[x] + self.members[y], key=self.rank.__getitem__)
        self.total[y] = self._params_with(y, self.consts[x])
        self.consts[y].update(self.consts[x])
        for a, d in depths.items():
            self.depth_in_cu[a] = d
        self.depth[y] = max(depths.values())
        for p in self.preds[x]:
            self.succs[p].discard(x)
            if p != y:
                self._link(p, y)
        for s in self.succs[x]:
            self.preds[s].discard(x)
            if s != y:
                self._link(y, s)
        self.preds[y].discard(x)
        for v in self.inputs_of[x]:
            self.input_readers[v].discard(x)
            self.input_readers[v].add(y)
        self.inputs_of[y] |= self.inputs_of[x]
        for table in (self.members, self.consts, self.total, self.depth, self.preds, self.succs, self.pos,
                      self.inputs_of, self.kind):
            del table[x]
        self.reasons.pop(x, None)
        self.reasons.pop(y, None)

    def result(self) -> Partition:
        cus = []
        for cu in self.order:
            if cu is None:
                continue
            nodes = [n for a in self.members[cu] for n in self.atoms.nodes[a]]
            params = self.params(cu)
            reason = self.reasons.get(cu, ROUNDS) if params < self.min_size else None
            cus.append(CU(nodes, params, self.depth[cu], reason,
                          self.fallback if self.kind[cu][0] else None, self.over_limit.get(cu),
                          self.kind[cu][1], REPEATING_MARK if self.kind[cu][2] else None))
        return Partition(cus)


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
    partitioner = _Partitioner(atoms, min_cu_size, max_cu_size, max_cu_depth, fallback, oversized)
    partitioner.grow()
    partitioner.merge_neighbours()
    part = partitioner.result()
    part.selects = list(branches.selects) if branches else []
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    for cu in part.cus:
        cu.nodes.sort(key=lambda n: position[id(n)])
    return part
