"""The glue between stages: load a model, bind its inputs, run the optimisation pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cortex.summary import GraphSummary, summarize_graph
from ir.graph import Graph
from ir.onnx_import import load_model
from passes import PassRecord, optimize_pipeline, run_pipeline


@dataclass
class OptimizedModel:
    path: Path
    source: GraphSummary     # the model as imported, before any pass
    graph: Graph
    records: list[PassRecord]


def load_and_optimize(model_path: str | Path, input_shapes: dict | None = None, dims: dict | None = None,
                      require_static: bool = True, on_pass: Callable | None = None,
                      frozen_inputs: dict | None = None) -> OptimizedModel:
    path = Path(model_path)
    graph = load_model(path)
    source = summarize_graph(graph)
    passes = optimize_pipeline(input_shapes, dims, require_static, frozen_inputs)
    graph, records = run_pipeline(graph, passes, on_pass)
    return OptimizedModel(path, source, graph, records)
