"""The atoms the partitioner places: fusion groups (never cut) and lone nodes, with what the
limits measure of each (its constants), the model inputs it reads, the atoms it waits for and
its kind (fallback, branch, repeating, --parallel slice: see `passes/partition.py`).

The Selects of hoisted Ifs (`branch_cus`) are no atoms: no CU holds them. A reader of an If's
output waits for the atoms writing its condition and every case, and a branch's atoms wait for
the atom writing their condition, so the CU graph orders them as the scheduler runs them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ir.errors import CortexError
from ir.graph import Graph, Node, Value, outer_reads
from passes.branch_cus import Branches, is_select


def node_constants(node: Node) -> list[Value]:
    """Constants a node reads, including those its subgraphs read."""
    found = [v for v in node.present_inputs if v.is_const]
    for sub in node.subgraphs:
        found.extend(sub.constants())
        for inner in sub.walk():
            for s in inner.subgraphs:
                found.extend(s.constants())
    return found


@dataclass
class Atoms:
    nodes: list[list[Node]]            # atom -> its nodes (graph order)
    preds: list[list[int]]             # atom -> producer atoms (deduplicated)
    succs: list[list[int]]
    consts: list[dict[int, int]]       # atom -> {id(const): elements}
    model_inputs: list[set[int]]       # atom -> ids of the model inputs it reads
    kinds: list[tuple]                 # atom -> (fallback, branch, repeating, slice): see the module doc


def build_atoms(graph: Graph, fallback_nodes: set[int] = frozenset(), branches: Branches | None = None,
                 repeating: set[int] | None = None, slices: dict[int, int] | None = None) -> Atoms:
    branches = branches or Branches()
    atom_of_group: dict[str, int] = {}
    atom_of_node: dict[int, int] = {}
    nodes: list[list[Node]] = []
    selects: dict[int, Node] = {}      # id(value) -> the Select writing it (no atom: no CU holds it)
    for node in graph.nodes:
        if is_select(node):
            selects[id(node.outputs[0])] = node
            continue
        if node.fusion_group is not None and node.fusion_group in atom_of_group:
            a = atom_of_group[node.fusion_group]
        else:
            a = len(nodes)
            nodes.append([])
            if node.fusion_group is not None:
                atom_of_group[node.fusion_group] = a
        nodes[a].append(node)
        atom_of_node[id(node)] = a
    producer_atom = {id(out): atom_of_node[id(n)] for n in graph.nodes if not is_select(n) for out in n.outputs}

    def producers(v: Value) -> list[int]:
        """The atoms a reader of `v` waits for: its producer's, or for an If's output, those
        writing the condition and every case."""
        if id(v) in selects:
            return [p for w in selects[id(v)].inputs for p in producers(w)]
        return [producer_atom[id(v)]] if id(v) in producer_atom else []
    preds: list[list[int]] = [[] for _ in nodes]
    succs: list[list[int]] = [[] for _ in nodes]
    consts: list[dict[int, int]] = [{} for _ in nodes]
    graph_inputs = {id(v) for v in graph.inputs}
    model_inputs: list[set[int]] = [set() for _ in nodes]
    for a, members in enumerate(nodes):
        seen = set()
        for node in members:
            for v in [*node.present_inputs, *outer_reads(node)]:
                if id(v) in graph_inputs:
                    model_inputs[a].add(id(v))
                for p in producers(v):
                    if p != a and p not in seen:
                        seen.add(p)
                        preds[a].append(p)
                        succs[p].append(a)
            for c in node_constants(node):
                consts[a][id(c)] = int(c.const.size)
    kinds = []
    for a, members in enumerate(nodes):
        # A branch CU also waits for its condition, which is what decides whether it runs.
        conds = [branches.activation[id(n)][0] for n in members if id(n) in branches.activation]
        for cond in conds[:1]:
            for p in producers(cond):
                if p != a and p not in preds[a]:
                    preds[a].append(p)
                    succs[p].append(a)
        branch = {branches.key(n) for n in members}
        if len(branch) > 1:
            raise AssertionError(f"a fusion group spans branches: {members[0].describe()}")
        kinds.append((any(id(n) in fallback_nodes for n in members), branch.pop(),
                      repeating is not None and all(id(n) in repeating for n in members),
                      (slices or {}).get(id(members[0]))))
    return Atoms(nodes, preds, succs, consts, model_inputs, kinds)


def atom_order(atoms: Atoms) -> list[int]:
    """Kahn's algorithm, always taking the atom that came first in the graph: deterministic, and it
    keeps chains together the way the model lists them."""
    indegree = [len(p) for p in atoms.preds]
    ready = [a for a, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        a = heapq.heappop(ready)
        order.append(a)
        for s in atoms.succs[a]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, s)
    if len(order) != len(atoms.nodes):
        raise CortexError("the fusion groups form a cycle; the graph cannot be partitioned")
    return order
