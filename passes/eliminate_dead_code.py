"""Remove nodes whose outputs nothing reads."""

from dataclasses import dataclass

from ir.graph import Graph, outer_reads
from passes.base import Pass


@dataclass
class EliminateDeadCode(Pass):
    name = "eliminate-dead-code"

    def run(self, graph: Graph) -> Graph:
        live = {id(v) for v in graph.outputs}
        kept = []
        for node in reversed(graph.nodes):
            if any(id(out) in live for out in node.outputs):
                kept.append(node)
                live.update(id(v) for v in node.present_inputs)
                for sub in node.subgraphs:
                    self.run(sub)
                live.update(id(v) for v in outer_reads(node))
        graph.nodes = kept[::-1]
        return graph
