"""Memory planning: place every activation buffer at an offset in one arena, reusing memory whose
tensor is dead.

Entry points
- `plan_memory(lifetimes, in_place=True) -> MemoryPlan`: the core. A `Lifetime` is one buffer to
  place: it lives from the step that writes it (`first_use`) to the last step that reads it
  (`last_use`), both inclusive; two buffers live at a common step never share a byte. A lifetime may
  name `may_alias_input`, a buffer whose last read is the step that writes this one (an elementwise
  op's input, a reshape's source): it is then placed at the same offset, in place, which the caller
  vouches is legal for that op. (Not to be confused with `ir.loops.program.Buffer`, a view of a
  loop-nest storage: lifetimes name what they place by a string.)
- `lifetimes_for_schedule(steps, sizes, inputs, outputs)`: lifetimes from a schedule given as
  (reads, writes) per step, e.g. the CU schedule of a whole model, each CU one step.
- `plan_dag_memory(dag)`: the tensors passed between CUs of a dag.json (`cortex.dag/1`), over its
  CU order: what a runtime keeping them in one arena would need.
- `plan_graph_memory(graph, ...)` / the `PlanMemory` pass: the activation buffers of a `Graph` in
  node order (inside one CU), with in-place reuse for elementwise and view ops.

`MemoryPlan.lower_bound` is the largest sum of live bytes at any step (an in-place pair counted once):
no placement can use less, so `arena_bytes / lower_bound` says how much the plan wastes.

Placement is greedy, as TFLite's "greedy by size" planner: take buffers in some order and give each
the best-fitting gap among the already placed buffers it is live with. The order matters, so three
orders are tried (by size, by lifetime length, by size x lifetime; ties by first use, then name)
and the smallest arena wins; everything is deterministic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ir.errors import CortexError
from ir.graph import Graph, Value
from ir.ops.registry import ELEMENTWISE, is_view, kind_of
from passes.base import Pass


@dataclass(frozen=True)
class Lifetime:
    name: str
    size: int                   # bytes
    first_use: int              # step that writes it (inputs: the first step)
    last_use: int               # last step that reads it (outputs: the last step)
    alignment: int = 16         # offsets are multiples of this (16: a v128 load never splits a line pair)
    may_alias_input: str | None = None


@dataclass
class MemoryPlan:
    offsets: dict[str, int]
    arena_bytes: int
    lower_bound: int
    aliases: dict[str, str] = field(default_factory=dict)   # buffer -> buffer whose memory it reuses
    strategy: str = ""

    @property
    def ratio(self) -> float:
        return self.arena_bytes / self.lower_bound if self.lower_bound else 1.0

    def to_json(self) -> dict:
        return {"arena_bytes": self.arena_bytes, "lower_bound": self.lower_bound, "strategy": self.strategy,
                "offsets": dict(sorted(self.offsets.items())), "aliases": dict(sorted(self.aliases.items()))}


@dataclass
class _Group:
    """Buffers sharing one offset (an in-place chain), placed as one."""
    members: list[Lifetime]
    size: int
    alignment: int
    first: int
    last: int

    @property
    def name(self) -> str:
        return self.members[0].name


def plan_memory(lifetimes: Iterable[Lifetime], in_place: bool = True) -> MemoryPlan:
    lifetimes = list(lifetimes)
    _validate(lifetimes)
    groups, aliases = _merge_in_place(lifetimes) if in_place else ([_single(b) for b in lifetimes], {})
    best: tuple[int, str, dict[str, int]] | None = None
    for strategy, key in _ORDERS.items():
        offsets = _place(sorted(groups, key=key))
        arena = max((offsets[g.name] + g.size for g in groups), default=0)
        if best is None or arena < best[0]:
            best = (arena, strategy, offsets)
    arena, strategy, group_offsets = best
    offsets = {b.name: group_offsets[g.name] for g in groups for b in g.members}
    return MemoryPlan({b.name: offsets[b.name] for b in lifetimes}, arena, _lower_bound(groups), aliases, strategy)


_ORDERS = {
    "greedy-by-size": lambda g: (-g.size, g.first, g.name),
    "greedy-by-lifetime": lambda g: (-(g.last - g.first), -g.size, g.first, g.name),
    "greedy-by-area": lambda g: (-g.size * (g.last - g.first + 1), g.first, g.name),
}


def _validate(lifetimes: list[Lifetime]) -> None:
    names = set()
    for b in lifetimes:
        if b.name in names:
            raise ValueError(f"buffer {b.name!r} listed twice")
        names.add(b.name)
        if b.size < 0 or b.first_use > b.last_use:
            raise ValueError(f"buffer {b.name!r}: bad size or lifetime ({b.size} bytes, steps {b.first_use}..{b.last_use})")
        if b.alignment < 1 or b.alignment & (b.alignment - 1):
            raise ValueError(f"buffer {b.name!r}: alignment {b.alignment} is not a power of two")


def _single(b: Lifetime) -> _Group:
    return _Group([b], b.size, b.alignment, b.first_use, b.last_use)


def _merge_in_place(lifetimes: list[Lifetime]) -> tuple[list[_Group], dict[str, str]]:
    """Chain each buffer onto the input it may overwrite, when that input dies where it is born."""
    by_name = {b.name: b for b in lifetimes}
    group_of: dict[str, _Group] = {}
    taken: set[str] = set()      # an input's memory goes to one output only
    aliases: dict[str, str] = {}
    for b in sorted(lifetimes, key=lambda b: (b.first_use, b.name)):
        src = by_name.get(b.may_alias_input) if b.may_alias_input else None
        if (src is not None and src.name not in taken and src.last_use == b.first_use
                and src.first_use < b.first_use and b.size <= src.size and src.name in group_of
                and group_of[src.name].last == src.last_use):
            g = group_of[src.name]
            g.members.append(b)
            g.alignment = max(g.alignment, b.alignment)
            g.last = max(g.last, b.last_use)
            taken.add(src.name)
            aliases[b.name] = src.name
            group_of[b.name] = g
        else:
            group_of[b.name] = _single(b)
    unique = {id(g): g for g in group_of.values()}
    return list(unique.values()), aliases


def _align(x: int, alignment: int) -> int:
    return -(-x // alignment) * alignment


def _place(order: list[_Group]) -> dict[str, int]:
    """Best fit: the smallest gap between already placed, simultaneously live groups that holds this
    one; past the highest of them when none does."""
    placed: list[tuple[int, int, _Group]] = []  # (offset, end, group)
    offsets: dict[str, int] = {}
    for g in order:
        live = sorted((off, end) for off, end, o in placed if o.first <= g.last and g.first <= o.last)
        best_offset, best_gap, cursor = None, None, 0
        for off, end in live:
            candidate = _align(cursor, g.alignment)
            if candidate + g.size <= off and (best_gap is None or off - candidate < best_gap):
                best_offset, best_gap = candidate, off - candidate
            cursor = max(cursor, end)
        if best_offset is None:
            best_offset = _align(cursor, g.alignment)
        offsets[g.name] = best_offset
        placed.append((best_offset, best_offset + g.size, g))
    return offsets


def _lower_bound(groups: list[_Group]) -> int:
    events: dict[int, int] = {}
    for g in groups:
        events[g.first] = events.get(g.first, 0) + g.size
        events[g.last + 1] = events.get(g.last + 1, 0) - g.size
    live = peak = 0
    for step in sorted(events):
        live += events[step]
        peak = max(peak, live)
    return peak


# -- lifetimes from a schedule ------------------------------------------------------------------

def lifetimes_for_schedule(steps: Sequence[tuple[Sequence[str], Sequence[str]]], sizes: dict[str, int],
                           inputs: Sequence[str] = (), outputs: Sequence[str] = (), alignment: int = 16,
                           in_place: dict[str, str] | None = None) -> list[Lifetime]:
    """Lifetimes of the tensors read and written by `steps` (a list of (reads, writes)). Inputs are live
    from step 0 (the host writes them before the run), outputs until the last step (read after it);
    a tensor written but never read still needs its step. `in_place` maps output -> input it may
    overwrite. Tensors missing from `sizes` (weights, constants) are not planned."""
    first: dict[str, int] = {name: 0 for name in inputs if name in sizes}
    last: dict[str, int] = dict(first)
    for step, (reads, writes) in enumerate(steps):
        for name in writes:
            if name in sizes:
                first.setdefault(name, step)
                last[name] = max(last.get(name, step), step)
        for name in reads:
            if name in sizes:
                first.setdefault(name, step)
                last[name] = max(last.get(name, step), step)
    end = max(len(steps) - 1, 0)
    for name in outputs:
        if name in first:
            last[name] = end
    in_place = in_place or {}
    return [Lifetime(name, sizes[name], first[name], last[name], alignment, in_place.get(name)) for name in first]


def plan_dag_memory(dag: dict, alignment: int = 16) -> MemoryPlan:
    """Plan the tensors crossing CU borders of a loaded dag.json, each CU one step of its order."""
    cus = {cu["id"]: cu for cu in dag["cus"]}
    steps = [(cus[cu_id]["inputs"], cus[cu_id]["outputs"]) for cu_id in dag["order"]]
    sizes = {name: int(t["bytes"]) for name, t in dag["tensors"].items()}
    lifetimes = lifetimes_for_schedule(steps, sizes, [t["name"] for t in dag["inputs"]],
                                       [t["name"] for t in dag["outputs"]], alignment)
    return plan_memory(lifetimes, in_place=False)  # a CU may read its inputs after writing an output


# -- graphs ---------------------------------------------------------------------------------------

def plan_graph_memory(graph: Graph, alignment: int = 16, in_place: bool = True,
                      include_io: bool = True) -> MemoryPlan:
    """Plan the tensors of `graph` in its node order. Constants (weights) live in data segments and are
    not planned; with `include_io`, graph inputs and outputs get arena space too."""
    io = {id(v) for v in graph.inputs} | {id(v) for v in graph.outputs}
    planned = [v for v in graph.values() if not v.is_const and v.is_tensor and (include_io or id(v) not in io)]
    sizes = {v.name: _nbytes(v) for v in planned}
    steps = [([v.name for v in _reads(node)], [v.name for v in node.outputs]) for node in graph.nodes]
    aliases = _in_place_candidates(graph, io) if in_place else {}
    lifetimes = lifetimes_for_schedule(steps, sizes, [v.name for v in graph.inputs if v.name in sizes],
                                       [v.name for v in graph.outputs if v.name in sizes], alignment, aliases)
    return plan_memory(lifetimes, in_place=in_place)


def _reads(node) -> list[Value]:
    reads = list(node.present_inputs)
    for sub in node.subgraphs:  # a subgraph's reads of outer values count for its owner
        inner = {id(v) for n in sub.walk() for v in n.outputs} | {id(v) for v in sub.inputs}
        reads += [v for n in sub.walk() for v in n.present_inputs if id(v) not in inner]
    return reads


def _nbytes(v: Value) -> int:
    try:
        return v.nbytes
    except (ValueError, TypeError):
        raise CortexError(f"cannot plan memory for tensor {v.name!r}: its shape {v.shape} is not static "
                          "(bind the model's inputs with --input-shape / --dim)") from None


def _in_place_candidates(graph: Graph, io: set[int]) -> dict[str, str]:
    """output -> input for ops that may write their output over an input that dies there (same size,
    read position by position: elementwise ops of one shape, and views)."""
    last_read: dict[int, int] = {}
    for step, node in enumerate(graph.nodes):
        for v in _reads(node):
            last_read[id(v)] = step
    found = {}
    for step, node in enumerate(graph.nodes):
        if len(node.outputs) != 1 or node.subgraphs:
            continue
        out = node.outputs[0]
        elementwise = kind_of(node.op_type, node.domain) == ELEMENTWISE
        if not (elementwise or (is_view(node.op_type) and not node.domain)):
            continue
        for v in node.present_inputs if elementwise else node.present_inputs[:1]:
            if (not v.is_const and v.is_tensor and id(v) not in io and last_read.get(id(v)) == step
                    and v.is_static and out.is_static and (v.shape == out.shape or not elementwise)
                    and v.nbytes == out.nbytes):
                found[out.name] = v.name
                break
    return found


@dataclass
class PlanMemory(Pass):
    """Plans the graph's activation memory and records it in the graph metadata as JSON under
    `cortex.memory_plan` (a CU's cu.onnx then carries its own plan); the graph is otherwise unchanged."""
    name = "plan-memory"
    alignment: int = 16
    in_place: bool = True
    include_io: bool = True

    def run(self, graph: Graph) -> Graph:
        self.plan = plan_graph_memory(graph, self.alignment, self.in_place, self.include_io)
        graph.metadata["cortex.memory_plan"] = json.dumps(self.plan.to_json(), sort_keys=True,
                                                          separators=(",", ":"))
        return graph
