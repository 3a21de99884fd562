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
from ir.ops import keeps_bound, lookup
from passes.expand_ops import declined_because
from passes.fuse_groups import fusion_groups


def lowering_of(node: Node):
    entry = lookup(node.op_type, node.domain)
    if entry is None or (entry.lowered_when is not None and not entry.lowered_when(node)):
        return None
    return entry.lowerings.get(BACKEND)


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
    """Nodes with neither a lowering nor an ONNX function body to expand, and nodes that read a
    value of data-dependent length (ir/bounds.py) without keeping it."""
    opset = graph.opset_imports.get("", 21)
    return [n for n in graph.nodes
            if lowering_of(n) is None and function_body(n, graph.opset_imports.get(n.domain, opset)) is None
            or cannot_read_bounded(n)]


def cannot_read_bounded(node: Node) -> bool:
    """A node reading a padded bounded value is lowered only where its op keeps the padding right
    and every output it computes still carries a data-dependent length."""
    if not any(v.is_bounded for v in node.present_inputs):
        return False
    return not keeps_bound(node) or any(not out.is_bounded for out in node.outputs if out.dtype)


def describe_unsupported(nodes: list[Node]) -> str:
    parts = []
    for heading, chosen in (("ops without a loop-nest lowering: ", [n for n in nodes if not cannot_read_bounded(n)]),
                            ("ops that cannot read a value whose length is known only at run time: ",
                             [n for n in nodes if cannot_read_bounded(n)])):
        by_op: dict[str, list[str]] = {}
        for n in chosen:
            by_op.setdefault(n.op_type if not n.domain else f"{n.domain}::{n.op_type}", []).append(
                (n.name or "?") + (f": {why}" if (why := declined_because(n)) else ""))
        listed = [f"{op} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" for op, names in sorted(by_op.items())]
        if listed:
            parts.append(heading + "; ".join(listed))
    return "; ".join(parts)
