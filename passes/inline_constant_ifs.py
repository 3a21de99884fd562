"""An If whose condition is a constant (often after `--freeze-input`) becomes the nodes of the
branch it takes. Its branches may differ in shape, which only the taken branch settles, so this
runs inside shape inference's fixed-point loop (`InferShapes`), right after constant folding.

The taken branch's nodes read enclosing values directly, as ONNX's outer scope does, so they move
into the enclosing graph unchanged; each of the If's outputs becomes an Identity of the matching
branch output, which keeps the output's name (it may be a model output) and which `Simplify`
removes afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir.graph import Graph, Node
from passes.base import Pass


@dataclass
class InlineConstantIfs(Pass):
    name = "inline-constant-ifs"

    def run(self, graph: Graph) -> Graph:
        inline_constant_ifs(graph)
        return graph


def inline_constant_ifs(graph: Graph) -> int:
    """Inline every If of `graph` (not of its subgraphs) whose condition is a constant; returns
    how many were inlined."""
    inlined, nodes = 0, []
    for node in graph.nodes:
        cond = node.inputs[0] if node.op_type == "If" and not node.domain and node.inputs else None
        if cond is None or not cond.is_const or np.asarray(cond.const).size != 1:
            nodes.append(node)
            continue
        branch = node.attrs["then_branch" if bool(np.asarray(cond.const).reshape(-1)[0]) else "else_branch"]
        nodes.extend(branch.nodes)
        for i, (out, result) in enumerate(zip(node.outputs, branch.outputs)):
            nodes.append(Node("Identity", [result], [out], name=f"{node.name or 'If'}_taken_{i}"))
        inlined += 1
    graph.nodes = nodes
    return inlined
