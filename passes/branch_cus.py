"""Large Ifs taken apart into branch CUs, so that only the taken branch runs.

An If compiles today as one op that holds both branches (the lowering computes both and picks
one). When a branch holds more parameters than `--min-cu-size`, that is work worth skipping, so
before partitioning the If is hoisted: each branch's nodes move into the enclosing graph (they read
enclosing values directly, as ONNX's outer scope does, so a cut makes them CU inputs), each tagged
with its activation (the condition and the value that selects the branch), and each branch output
becomes a tensor of its own (an Identity where the branch returns an outer value or a constant, so
that some node of that branch writes it). The If's outputs are then written by `Select` nodes
(domain `cortex`) that no CU holds: dag.json lists them as `selects`, and the scheduler resolves
each one from the case its condition picks.

Only Ifs of the top-level graph are hoisted; an If nested in a branch stays one op of that
branch's CU (its activation would be a conjunction, which dag.json cannot state). An If whose
branches disagree in dtype or static shape stays too (a select's output has one shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from onnx import TensorProto

from ir.graph import Graph, Node, Value
from passes.fuse_groups import fusion_groups

SELECT_DOMAIN = "cortex"
SELECT_OP = "Select"


@dataclass
class Select:
    """One If output: the case tensor the condition's value picks."""
    node: Node                         # the placeholder writing `output` in the graph
    output: Value
    condition: Value
    cases: list[tuple[bool, Value]]


@dataclass
class Branches:
    activation: dict[int, tuple[Value, bool]] = field(default_factory=dict)   # id(node) -> (condition, value)
    selects: list[Select] = field(default_factory=list)
    split_ops: int = 0                 # ops of hoisted branches split to fit --max-cu-size

    def key(self, node: Node) -> tuple[str, bool] | None:
        found = self.activation.get(id(node))
        return None if found is None else (found[0].name, found[1])


def is_select(node: Node) -> bool:
    return node.op_type == SELECT_OP and node.domain == SELECT_DOMAIN


def hoist_large_ifs(graph: Graph, min_params: int, prepare: Callable[[Graph], int] | None = None) -> Branches:
    """Hoist every top-level If one of whose branches holds more than `min_params` parameters;
    `prepare(body)` rewrites each branch body first (the partitioner splits its too-large ops)
    and returns how many ops it split."""
    branches = Branches()
    nodes: list[Node] = []
    for node in graph.nodes:
        if _hoistable(node) and max(map(_branch_params, _bodies(node))) > min_params:
            if prepare is not None:
                branches.split_ops += sum(prepare(body) for body in _bodies(node))
            nodes.extend(_hoist(graph, node, branches))
        else:
            nodes.append(node)
    graph.nodes = nodes
    if branches.selects:
        _rename_clashes(graph, branches)
    return branches


def _bodies(node: Node) -> tuple[Graph, Graph]:
    return node.attrs["then_branch"], node.attrs["else_branch"]


def _hoistable(node: Node) -> bool:
    if node.op_type != "If" or node.domain or not node.inputs or node.inputs[0] is None:
        return False
    cond = node.inputs[0]
    if node.attrs.get("then_branch") is node.attrs.get("else_branch"):
        return False       # one body object for both: hoisting would place its nodes twice
    if cond.is_const or not cond.is_static or cond.numel != 1 or cond.dtype != TensorProto.BOOL:
        return False
    for i, out in enumerate(node.outputs):
        if not (out.is_tensor and out.is_static):
            return False
        for body in _bodies(node):
            case = body.outputs[i]
            if not case.is_tensor or case.dtype != out.dtype or case.shape is None or tuple(case.shape) != tuple(out.shape):
                return False
    return True


def _branch_params(body: Graph) -> int:
    seen: dict[int, int] = {}
    for g in [body, *(s for n in body.walk() for s in n.subgraphs)]:
        for c in g.constants():
            seen[id(c)] = int(np.asarray(c.const).size)
    return sum(seen.values())


def _hoist(graph: Graph, node: Node, branches: Branches) -> list[Node]:
    cond = node.inputs[0]
    hoisted: list[Node] = []
    cases: list[list[tuple[bool, Value]]] = [[] for _ in node.outputs]
    for value, body in zip((True, False), _bodies(node)):
        side = "then" if value else "else"
        own = {id(o) for n in body.nodes for o in n.outputs}
        members = list(body.nodes)
        used: set[int] = set()
        for i, (out, result) in enumerate(zip(node.outputs, body.outputs)):
            if id(result) not in own or id(result) in used:
                # The branch passes an outer value, a constant or a tensor it already returns:
                # copy it, so this branch's CU writes a case tensor of its own.
                copy = Value(graph.fresh_name(f"{out.name}_{side}"), out.dtype, out.shape)
                members.append(Node("Identity", [result], [copy], name=graph.fresh_name(f"{node.name or 'If'}_{side}_{i}")))
                result = copy
            used.add(id(result))
            cases[i].append((value, result))
        # The branch's nodes had no fusion groups (FuseGroups leaves bodies alone); now that they
        # are CU nodes, they get the groups the one rule gives them within the branch.
        cases_here = [c for per_output in cases for v, c in per_output if v == value]
        label = graph.fresh_name(f"{node.name or 'If'}_{side}_fusion")
        for k, group in enumerate(fusion_groups(Graph(nodes=members, outputs=cases_here))):
            for member in group:
                member.fusion_group = f"{label}_{k}"
        for member in members:
            branches.activation[id(member)] = (cond, value)
            for sub in member.subgraphs:
                sub.parent = graph
        hoisted.extend(members)
    for i, out in enumerate(node.outputs):
        select = Node(SELECT_OP, [cond, *(case for _, case in cases[i])], [out], domain=SELECT_DOMAIN,
                      name=graph.fresh_name(f"{node.name or 'If'}_select_{i}"))
        branches.selects.append(Select(select, out, cond, cases[i]))
        hoisted.append(select)
    return hoisted


def _rename_clashes(graph: Graph, branches: Branches) -> None:
    """ONNX lets the two branches of an If (and a branch and the enclosing graph's constants) use
    the same value names; once hoisted they share one namespace, so later ones get fresh names."""
    taken: set[str] = {v.name for v in graph.inputs}
    for node in graph.nodes:
        if id(node) not in branches.activation and not is_select(node):
            taken.update(v.name for v in [*node.present_inputs, *node.outputs])
    seen: set[int] = set()
    for node in graph.nodes:
        if id(node) not in branches.activation:
            continue
        for v in [*node.present_inputs, *node.outputs]:
            if id(v) in seen or (not v.is_const and v.producer is not node):
                continue
            seen.add(id(v))
            if v.name in taken:
                v.name = graph.fresh_name(v.name)
            taken.add(v.name)
