"""What every pass is: a small object with a `name`, its options as fields, and `run(graph)`, which
returns what the pass makes: the rewritten Graph for the passes of a pipeline (`run_pipeline`),
the Partition for PartitionIntoCUs, which runs after the pipeline."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

from ir.graph import Graph, Node


class Pass:
    name: ClassVar[str] = "pass"

    def run(self, graph: Graph):
        raise NotImplementedError


@dataclass
class PassRecord:
    """What one pass did, for `cortex inspect` and the summaries."""
    name: str
    nodes_before: int
    nodes_after: int
    seconds: float


def run_pipeline(graph: Graph, passes: Sequence[Pass],
                 on_pass: Callable[[Pass], None] | None = None) -> tuple[Graph, list[PassRecord]]:
    records = []
    for p in passes:
        if on_pass:
            on_pass(p)
        before, start = len(graph.nodes), time.perf_counter()
        graph = p.run(graph)
        records.append(PassRecord(p.name, before, len(graph.nodes), time.perf_counter() - start))
    return graph, records


def rewrite_nodes(graph: Graph, rewrite: Callable[[Node], list[Node] | None]) -> int:
    """Replace each node of `graph`, in order, by the nodes `rewrite(node)` returns (None: keep
    it); returns how many were replaced."""
    nodes: list[Node] = []
    replaced = 0
    for node in graph.nodes:
        replacement = rewrite(node)
        if replacement is None:
            nodes.append(node)
        else:
            nodes.extend(replacement)
            replaced += 1
    graph.nodes = nodes
    return replaced
