"""What the Ray executor runs where (`cortex/runtime/ray_executor.py`): the stages, each stage's part
of dag.json, and per request which stages are called, what each returns and what it reads.

Stages are contiguous parts of dag.json's topological `order`, balanced by flops (`stage_cuts`).
A stage's actor runs the normal scheduler on its part (`stage_dag`), so every decision about a
CU (inactive branch, not needed, cache hit, variant) is made there with the local scheduler's own
code; this module only makes sure each stage holds what those decisions read.

Conditional CUs. A branch CU's condition, and the condition of a select it writes a case of, are
read by its turn like its inputs, so they are shipped to its stage with them. A select's tensor
(an If's output, which no CU produces) may come from every stage holding one of its cases: the
stage whose case the condition picks resolves it and returns it, the others never made it. A
stage returns only the tensors that exist after its walk: a CU of an untaken branch never ran, so
its outputs are not shipped anywhere. Which branch is taken is known only once the condition is
computed, on an actor; the plan is made before, for both branches, so a request's calls can all
be submitted at once (pipelined) and the actors skip what the condition rules out.

A Compiled Graph (`cortex/runtime/ray_compiled.py`) runs the same plan as a chain through every
stage: `Planner.chain` says per stage whether it runs, what it returns, and which tensors it passes
on to the stages after it and the caller. That holds for both branches too, so the graph is static.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cortex.runtime.policy import Policy
from ir.errors import CortexError


def pipeline_shape(stages: int | None, replicas: int | None, free_cpus: float, num_cpus: float, cu_count: int,
                   model_memory: int, node_memory: int, compiled_graph: bool) -> tuple[int, int]:
    """How many stages a pipeline has and how many copies (replicas) of it run, from what was asked
    and what the cluster has. Asked for neither: as many replicas of the whole model as the free
    CPUs hold, when one node's memory holds the model (no tensor then crosses a node within a
    request, and each node adds a whole pipeline's throughput); otherwise, or under
    compiled_graph, which drives one pipeline, one pipeline of as many stages as the CPUs hold."""
    slots = max(1, int(free_cpus // num_cpus))
    if stages is None and replicas is None:
        if compiled_graph or model_memory > node_memory:
            stages, replicas = slots, 1
        else:
            stages, replicas = 1, slots
    stages, replicas = min(stages or 1, cu_count), replicas or 1
    if compiled_graph and replicas > 1:
        raise CortexError(f"the ray executor's compiled_graph drives one pipeline, not {replicas} replicas: "
                          "leave replicas at 1")
    wanted = stages * replicas * num_cpus
    if wanted > free_cpus + 1e-9:
        raise CortexError(f"the Ray cluster has {free_cpus:g} free CPUs, {replicas} x {stages} stages of "
                          f"{num_cpus:g} CPUs need {wanted:g}: close other models (model.close()) or ask for "
                          "fewer stages or replicas")
    return stages, replicas


def stage_cuts(costs: list[float], stages: int) -> list[int]:
    """Where to cut a list of costs into `stages` contiguous parts so that the costliest part is as
    cheap as possible (the start index of each part after the first): the classic linear partition,
    by binary search on the bound with a greedy fill."""
    stages = max(1, min(stages, len(costs)))

    def parts(bound: float) -> list[int] | None:
        cuts, total = [], 0.0
        for i, c in enumerate(costs):
            if total + c > bound and total > 0:
                cuts.append(i)
                total = 0.0
            total += c
        return cuts if len(cuts) < stages else None

    lo, hi = max(costs, default=0.0), sum(costs)
    for _ in range(60):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        if parts(mid) is None:
            lo = mid
        else:
            hi = mid
    cuts = parts(hi) or []
    # Use every stage asked for when the bound allows fewer: split the costliest parts further.
    while len(cuts) < stages - 1:
        bounds = [0, *cuts, len(costs)]
        widest = max(range(len(bounds) - 1), key=lambda k: (bounds[k + 1] - bounds[k] > 1,
                                                           sum(costs[bounds[k]:bounds[k + 1]])))
        a, b = bounds[widest], bounds[widest + 1]
        if b - a < 2:
            break
        cuts = sorted([*cuts, (a + b) // 2])
    return cuts


def stage_dag(dag: dict, cu_ids: list[str]) -> dict:
    """The part of dag.json one actor runs: its CUs, every tensor, producers outside it unknown
    (their tensors arrive as inputs), and of each select the cases its CUs write."""
    mine = set(cu_ids)
    producer = {name: t["producer"] for name, t in dag["tensors"].items()}
    part = {**dag, "cus": [cu for cu in dag["cus"] if cu["id"] in mine], "order": list(cu_ids),
            "tensors": {name: {**t, "producer": t["producer"] if t["producer"] in mine else None}
                        for name, t in dag["tensors"].items()}}
    if "selects" in dag:
        part["selects"] = [{**s, "cases": cases} for s in dag["selects"]
                           if (cases := [c for c in s["cases"] if producer.get(c["tensor"]) in mine])]
    return part


@dataclass(frozen=True)
class ChainStep:
    """One stage's part of a request in a Compiled Graph's chain."""
    runs: bool
    returns: tuple[str, ...]            # its own tensors that later stages or the caller read
    passes_on: frozenset[str]           # of what it received and made: what later stages or the caller read


@dataclass(frozen=True)
class Chain:
    """A request's plan as the stages of a chain read it, one step per stage, every stage listed."""
    policy: Policy
    steps: tuple[ChainStep, ...]


@dataclass
class StageCall:
    """One stage's part of a request."""
    stage: int
    returns: list[str] = field(default_factory=list)   # tensors later stages or the caller read from it
    reads: list[int] = field(default_factory=list)     # earlier stages whose returned tensors it reads
    feeds: bool = False                                 # whether it reads model inputs


class Planner:
    def __init__(self, dag: dict, stages: list[list[str]]):
        self.stages = stages
        self.cus = {cu["id"]: cu for cu in dag["cus"]}
        self.producer = {name: t["producer"] for name, t in dag["tensors"].items()}
        self.stage_of = {cu_id: k for k, ids in enumerate(stages) for cu_id in ids}
        self.model_inputs = {spec["name"] for spec in dag["inputs"]}
        self.selects = {s["tensor"]: s for s in dag.get("selects", [])}
        self.conditions_of: dict[str, list[str]] = {}     # CU -> conditions of the selects it writes a case of
        for s in dag.get("selects", []):
            for case in s["cases"]:
                self.conditions_of.setdefault(self.producer[case["tensor"]], []).append(s["condition"])

    def reads(self, cu_id: str) -> list[str]:
        """What a CU's turn reads: its inputs, its activation condition, its selects' conditions."""
        cu = self.cus[cu_id]
        extra = [cu["activation"]["tensor"]] if "activation" in cu else []
        return [*cu["inputs"], *extra, *self.conditions_of.get(cu_id, ())]

    def sources(self, name: str, needed: set[str]) -> list[int]:
        """The stages that may return `name`: its producer's, or for a select each case's."""
        if name in self.selects:
            cases = [self.producer[c["tensor"]] for c in self.selects[name]["cases"]]
            return sorted({self.stage_of[p] for p in cases if p in needed})
        producer = self.producer.get(name)
        return [self.stage_of[producer]] if producer in needed else []

    def plan(self, needed: set[str], outputs: list[str]) -> list[StageCall]:
        """The calls of a request whose CUs that may run are `needed`, in stage order."""
        calls: dict[int, StageCall] = {}
        for k, ids in enumerate(self.stages):
            mine = [cu_id for cu_id in ids if cu_id in needed]
            if not mine:
                continue
            call = calls[k] = StageCall(k)
            for name in dict.fromkeys(name for cu_id in mine for name in self.reads(cu_id)):
                call.feeds |= name in self.model_inputs
                for j in self.sources(name, needed):
                    if j != k:
                        _add(calls[j].returns, name)
                        _add(call.reads, j)
        for name in outputs:
            for j in self.sources(name, needed):
                _add(calls[j].returns, name)
        return [calls[k] for k in sorted(calls)]

    def chain(self, policy: Policy, plan: list[StageCall], needed: set[str], outputs: list[str]) -> Chain:
        """`plan` as a chain through every stage: a stage passes on the outputs and whatever a needed
        CU of a later stage reads (model inputs included: they enter at the first stage)."""
        calls = {call.stage: call for call in plan}
        later, steps = set(outputs), []
        for k in reversed(range(len(self.stages))):
            call = calls.get(k)
            steps.append(ChainStep(call is not None, tuple(call.returns) if call else (), frozenset(later)))
            later |= {name for cu_id in self.stages[k] if cu_id in needed for name in self.reads(cu_id)}
        return Chain(policy, tuple(reversed(steps)))


def _add(items: list, item) -> None:
    if item not in items:
        items.append(item)
