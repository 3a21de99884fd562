"""Move the computations of small broadcast operands up to where their inputs are ready.

`quantize_dynamic` writes a dynamically quantized product as DynamicQuantizeLinear ->
MatMulInteger -> Cast -> Mul(a_scale * b_scale), and lists the scalar Mul(a_scale, b_scale) after
the MatMulInteger. FuseGroups lets a group read an operand from outside only when that operand's
producer comes before the group's anchor in graph order (which is what keeps the group convex and
the operand computed when the kernel runs), so such a Mul would keep the Cast and the Mul by the
scale out of the product's kernel. This pass places every elementwise node whose non-constant
inputs are all scalars (numel 1) right after the last producer of its inputs (stable otherwise):
the order stays topological, and only scalar-sized work moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ir.graph import Graph, Node
from ir.ops import ELEMENTWISE, kind_of
from passes.base import Pass


@dataclass
class HoistScalarOperands(Pass):
    name = "hoist-scalar-operands"

    def run(self, graph: Graph) -> Graph:
        hoist_scalar_operands(graph)
        return graph


def _hoistable(node: Node) -> bool:
    return (node.domain in ("", "ai.onnx") and not node.subgraphs and len(node.outputs) == 1
            and kind_of(node.op_type, node.domain) == ELEMENTWISE and bool(node.present_inputs)
            and all(v.is_const or (v.is_static and v.numel == 1) for v in node.present_inputs)
            and not all(v.is_const for v in node.present_inputs))


def hoist_scalar_operands(graph: Graph) -> int:
    """Reorder `graph.nodes` as the module docstring says; returns how many nodes moved."""
    key_of_value: dict[int, tuple[int, int, int]] = {}
    keys = []
    for i, node in enumerate(graph.nodes):
        if _hoistable(node):
            ready = max((key_of_value[id(v)] for v in node.present_inputs if id(v) in key_of_value),
                        default=(-1, 0, -1))
            key = (ready[0], ready[1] + 1, i)   # after its inputs' last producer, before what followed it
        else:
            key = (i, 0, i)
        keys.append(key)
        for out in node.outputs:
            key_of_value[id(out)] = key
    order = sorted(range(len(graph.nodes)), key=keys.__getitem__)
    moved = sum(1 for position, i in enumerate(order) if position != i)
    graph.nodes = [graph.nodes[i] for i in order]
    return moved
