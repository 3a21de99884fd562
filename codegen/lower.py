"""Lowering a graph to loop nests: each node through the lowering registered next to its op
(`ir/ops/`), or through its ONNX function body when it has none (`function_bodies`).

This sits above the IR because it joins its parts: the op registry, the loop-nest builder, the
optimisation passes that bind a function body's shapes, and the fusion groups of
`passes/fuse_groups.py`, which decide which nodes a kernel may absorb as its epilogue.
"""

from __future__ import annotations

from codegen.function_bodies import expand, function_body
from ir.errors import UnsupportedError
from ir.graph import Graph, Node
from ir.loops.builder import BACKEND, LoopBuilder
from ir.loops.contraction import ContractionKernels
from ir.loops.program import Program
from ir.ops import lookup
from passes.fuse_groups import fusion_groups


def lowering_of(node: Node):
    entry = lookup(node.op_type, node.domain)
    return entry.lowerings.get(BACKEND) if entry else None


def lower_graph(graph: Graph, kernels: ContractionKernels | None = None) -> Program:
    """`kernels`: the target's ready-made contraction kernels (`ir/loops/contraction.py`), if any."""
    unsupported = unsupported_nodes(graph)
    if unsupported:
        raise UnsupportedError(describe_unsupported(unsupported))
    group_of = {id(member): i for i, members in enumerate(fusion_groups(graph)) for member in members}
    b = LoopBuilder(graph, kernels, lowering_of, expand, group_of)
    for node in graph.nodes:
        b.lower(node)
    return b.finish()


def unsupported_nodes(graph: Graph) -> list[Node]:
    """Nodes with neither a lowering nor an ONNX function body to expand."""
    opset = graph.opset_imports.get("", 21)
    return [n for n in graph.nodes
            if lowering_of(n) is None and function_body(n, graph.opset_imports.get(n.domain, opset)) is None]


def describe_unsupported(nodes: list[Node]) -> str:
    by_op: dict[str, list[str]] = {}
    for n in nodes:
        by_op.setdefault(n.op_type if not n.domain else f"{n.domain}::{n.op_type}", []).append(n.name or "?")
    parts = [f"{op} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" for op, names in sorted(by_op.items())]
    return "ops without a loop-nest lowering: " + "; ".join(parts)
