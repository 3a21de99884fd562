"""Group the atoms of a graph (`cu_atoms`) into CUs under the partition's limits (`partition.py`).

How it stays near-linear on large graphs:
1. Greedy, in topological order of atoms: an atom joins the CU of its most recently created
   producer CU, if depth and size allow, otherwise starts a new CU. Joining the newest producer CU
   keeps "creation order is a topological order of the CU graph", and under that invariant the
   join is always convex: no other producer CU can be downstream of the newest one.
2. Merges of neighbouring CUs, then of siblings reading the same tensor (small CUs first): a merge
   of X and Y (X earlier in the order) is convex when no path from X reaches Y other than a direct
   edge; the search for one only visits CUs that lie between X and Y in the current topological
   order, and the same search yields the reordering that keeps the order topological.

Atoms join and merge only with CUs of their kind (fallback, branch, repeating, slice): a join that
is refused starts a new CU, and a merge is still checked, so both phases keep their convexity
arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ir.errors import CortexError
from passes.cu_atoms import Atoms, atom_order

DEPTH = "merging would exceed --max-cu-depth"
SIZE = "merging would exceed --max-cu-size"
CONVEXITY = "merging would break convexity (a path leaves and re-enters)"
ALONE = "no neighbouring CU"
ROUNDS = "the merge rounds ran out"
FALLBACK = "a fallback CU merges only with fallback CUs"
BRANCH = "a branch CU merges only with CUs of the same branch"
REPEATING = "work on --cache-inputs alone merges only with such work"
SLICE = "a --parallel slice merges only with slices of the same index"
KIND_REASONS = (FALLBACK, BRANCH, REPEATING, SLICE)   # in the order of an atom kind's fields
MAX_SIBLINGS = 8  # siblings tried per CU, and the widest fan-out searched for them: they bound
MAX_FAN = 64      # the merge phase's cost on very wide graphs


@dataclass(slots=True, eq=False)
class CURecord:
    """One CU while it grows and merges: what the limits and the convexity checks read of it.
    Other CUs are named by their number (the index of the CU at its creation)."""
    kind: tuple                       # its atoms' kind (fallback, branch, repeating, slice: `cu_atoms`)
    atoms: list[int] = field(default_factory=list)          # in topological order
    consts: dict[int, int] = field(default_factory=dict)    # id(const) -> elements, each counted once
    params: int = 0                   # the sum of `consts`
    depth: int = 0                    # the longest atom path inside it
    preds: set[int] = field(default_factory=set)            # the CUs it reads
    succs: set[int] = field(default_factory=set)            # the CUs reading it
    model_inputs: set[int] = field(default_factory=set)     # ids of the model inputs it reads
    over_limit: str | None = None     # why it holds more than max_size (an indivisible op alone)
    merge_refused: str | None = None  # why its last merge attempt failed

    def params_with(self, extra: dict[int, int]) -> int:
        """Its parameters once it also holds the constants `extra` (shared ones count once)."""
        mine = self.consts
        return self.params + sum(n for k, n in extra.items() if k not in mine)


def group_atoms(atoms: Atoms, min_size: int, max_size: int | None, max_depth: int,
                oversized: dict[int, str] | None = None) -> list[CURecord]:
    """The CUs of `atoms`, in a topological order of the CU graph; `oversized` (id(node) -> why)
    are the ops that may exceed max_size, each alone in its CU."""
    grouping = _Grouping(atoms, min_size, max_size, max_depth, oversized or {})
    grouping.grow()
    grouping.merge_neighbours()
    return [grouping.cus[cu] for cu in grouping.order if cu is not None]


class _Grouping:
    def __init__(self, atoms: Atoms, min_size: int, max_size: int | None, max_depth: int,
                 oversized: dict[int, str]):
        self.atoms, self.min_size, self.max_depth = atoms, min_size, max_depth
        self.oversized = oversized                    # id(node) -> why it cannot be divided
        self.max_size = max_size if max_size is not None else float("inf")
        self.rank = [0] * len(atoms.nodes)            # atom -> position in topological order
        self.cu_of: list[int] = [-1] * len(atoms.nodes)
        self.depth_in_cu: list[int] = [0] * len(atoms.nodes)
        self.cus: dict[int, CURecord] = {}            # the CUs alive, by number
        self.order: list[int | None] = []             # CUs in topological order (None: merged away)
        self.pos: list[int] = []                      # CU -> its index in `order`
        self.input_readers: dict[int, set[int]] = {}  # model input -> CUs reading it
        self.latest_reader: dict[int, int] = {}       # model input -> newest CU reading it (greedy phase)

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
                self.cus[self._new_cu(a, pred_cus)].over_limit = "; ".join(reasons)
                continue
            target = max(pred_cus, key=self.pos.__getitem__) if pred_cus else None
            kind = self.atoms.kinds[a]
            if target is not None:
                d = 1 + max(self.depth_in_cu[p] for p in self.atoms.preds[a] if self.cu_of[p] == target)
                joined = self.cus[target]
                if joined.kind == kind and d <= self.max_depth \
                        and joined.params_with(self.atoms.consts[a]) <= self.max_size:
                    self._add(target, a, d)
                    for p in pred_cus - {target}:
                        self._link(p, target)
                    continue
            else:
                # An atom fed only by model inputs joins the newest CU reading one of them: it has
                # no producer, so no path can enter it and the join is convex wherever it goes.
                readers = [self.latest_reader[v] for v in self.atoms.model_inputs[a]
                           if v in self.latest_reader and self.cus[self.latest_reader[v]].kind == kind]
                reader = max(readers, key=self.pos.__getitem__, default=None)
                if reader is not None and self.cus[reader].params_with(self.atoms.consts[a]) <= self.max_size:
                    self._add(reader, a, 1)
                    continue
            self._new_cu(a, pred_cus)

    def _new_cu(self, a: int, pred_cus: set[int]) -> int:
        """A new CU, last in the order, holding atom `a`, which reads `pred_cus`."""
        cu = len(self.order)
        self.cus[cu] = CURecord(self.atoms.kinds[a])
        self.pos.append(len(self.order))
        self.order.append(cu)
        self._add(cu, a, 1)
        for p in pred_cus:
            self._link(p, cu)
        return cu

    def _add(self, cu: int, a: int, depth: int) -> None:
        record = self.cus[cu]
        self.cu_of[a] = cu
        self.depth_in_cu[a] = depth
        record.atoms.append(a)
        record.params = record.params_with(self.atoms.consts[a])
        record.consts.update(self.atoms.consts[a])
        record.depth = max(record.depth, depth)
        for v in self.atoms.model_inputs[a]:
            record.model_inputs.add(v)
            self.input_readers.setdefault(v, set()).add(cu)
            if v not in self.latest_reader or self.pos[cu] > self.pos[self.latest_reader[v]]:
                self.latest_reader[v] = cu

    def _link(self, src: int, dst: int) -> None:
        self.cus[src].succs.add(dst)
        self.cus[dst].preds.add(src)

    # merge phase
    def merge_neighbours(self, rounds: int = 8) -> None:
        # Each round tries every CU once; a merge can enable another, so repeat while any happened
        # (two or three rounds in practice; the cap bounds the cost).
        for _ in range(rounds):
            merged = False
            alive = sorted(self.cus, key=lambda c: (self.cus[c].params >= self.min_size, self.cus[c].params,
                                                    self.pos[c]))
            for cu in alive:
                if cu in self.cus and self._merge_best_neighbour(cu):
                    merged = True
            if not merged:
                break

    def _candidates(self, cu: int) -> list[tuple[int, int]]:
        """(rank, CU) to try merging with: neighbours first (a merge removes the tensors between
        them), then siblings that read the same producer's or model input's tensors (the shared
        tensor then crosses one border fewer), nearest in the order first."""
        record = self.cus[cu]
        neighbours = record.preds | record.succs
        siblings: set[int] = set()
        for group in [*(self.cus[p].succs for p in record.preds), *(self.cus[s].preds for s in record.succs),
                      *(self.input_readers[v] for v in record.model_inputs)]:
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
            key = (rank, self.cus[x].params_with(self.cus[y].consts))
            if best is None or key < best[0]:
                best = (key, x, y, depths, between)
        if best is None:
            self.cus[cu].merge_refused = "; ".join(sorted(reasons)) or ALONE
            return False
        _, x, y, depths, between = best
        self._merge(x, y, depths, between)
        return True

    def _try(self, x: int, y: int):
        """Merge X into Y (X earlier in the order)? Returns why not, or the new atom depths and the
        CUs that lie between them in the order and are reachable from X (moved after the merged CU)."""
        first, second = self.cus[x], self.cus[y]
        if first.kind != second.kind:
            return next(why for why, mine, theirs in zip(KIND_REASONS, first.kind, second.kind) if mine != theirs)
        if first.params_with(second.consts) > self.max_size:
            return SIZE
        depths = self._merged_depths(first.atoms + second.atoms)
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
        stack = [s for s in self.cus[x].succs if s != y]
        while stack:
            c = stack.pop()
            if c in seen or self.pos[c] > limit:
                continue
            if c == y:
                return None
            seen.add(c)
            stack.extend(self.cus[c].succs)
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
        gone, kept = self.cus.pop(x), self.cus[y]
        for a in gone.atoms:
            self.cu_of[a] = y
        kept.atoms = sorted(gone.atoms + kept.atoms, key=self.rank.__getitem__)
        kept.params = kept.params_with(gone.consts)
        kept.consts.update(gone.consts)
        for a, d in depths.items():
            self.depth_in_cu[a] = d
        kept.depth = max(depths.values())
        for p in gone.preds:
            self.cus[p].succs.discard(x)
            if p != y:
                self._link(p, y)
        for s in gone.succs:
            self.cus[s].preds.discard(x)
            if s != y:
                self._link(y, s)
        kept.preds.discard(x)
        for v in gone.model_inputs:
            self.input_readers[v].discard(x)
            self.input_readers[v].add(y)
        kept.model_inputs |= gone.model_inputs
        kept.merge_refused = None
