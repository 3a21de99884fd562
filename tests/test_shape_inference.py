"""Once the inputs are bound, shape inference leaves no unknown dim, and shape computations fold away.

A value counts when a node reads it or it is a graph output: those are the shapes the partitioner,
the memory planner and the backends need. Models whose inputs are static need no binding; MiniLM and
the samples with dynamic axes are bound the way a user binds them (`--dim` / `--input-shape`).
"""

from __future__ import annotations

import onnx
import pytest

from ir.graph import Graph
from ir.onnx_import import load_model
from passes import InferShapes, optimize_pipeline, run_pipeline
from testdata import (LIGHT_MODEL_NAMES, SAMPLE_NAMES, ModelCase, light_model, minilm, run_onnxruntime, sample_model,
                      sample_models)


def values_without_static_shape(graph: Graph) -> list[str]:
    read = {id(v) for node in graph.walk() for v in node.present_inputs}
    read.update(id(v) for v in graph.outputs)
    unknown = []
    for node in graph.walk():
        for out in node.outputs:
            if id(out) in read and out.is_tensor and not out.is_static:
                unknown.append(f"{out.name} ({node.op_type}): {out.shape}")
    unknown += [f"input {v.name}: {v.shape}" for v in graph.inputs if v.is_tensor and not v.is_static]
    return unknown


def inferred(case: ModelCase, input_shapes=None, dims=None) -> Graph:
    graph = load_model(case.path)
    shapes = case.input_shapes if input_shapes is None else input_shapes
    return InferShapes(shapes, case.dims if dims is None else dims, require_static=True).run(graph)


def optimized(case: ModelCase) -> Graph:
    graph, _ = run_pipeline(load_model(case.path), optimize_pipeline(case.input_shapes, case.dims, True))
    return graph


def assert_declared_output_shapes_hold(graph: Graph, case: ModelCase) -> None:
    for v in graph.outputs:
        assert v.shape == tuple(case.outputs[v.name].shape), f"output {v.name}: {v.shape}"


@pytest.mark.parametrize("name", LIGHT_MODEL_NAMES)
def test_light_model_has_only_static_shapes(name):
    case = light_model(name)
    graph = inferred(case)
    assert values_without_static_shape(graph) == []
    assert_declared_output_shapes_hold(graph, case)


@pytest.mark.parametrize("case", sample_models(), ids=str)
def test_sample_model_has_only_static_shapes_once_its_dims_are_bound(case):
    graph = inferred(case, input_shapes={})  # bound by --dim alone
    assert values_without_static_shape(graph) == []
    assert_declared_output_shapes_hold(graph, case)


def test_minilm_has_only_static_shapes_once_batch_and_seq_are_bound():
    case = minilm(batch=1, seq=128)
    graph = inferred(case, input_shapes={}, dims={"batch": 1, "seq": 128})
    assert values_without_static_shape(graph) == []
    assert_declared_output_shapes_hold(graph, case)


def test_minilm_input_shapes_bind_as_well_as_dims():
    case = minilm(batch=1, seq=128)
    graph = inferred(case, input_shapes={"input_ids": (1, 128), "attention_mask": (1, 128)}, dims={})
    assert values_without_static_shape(graph) == []


def test_minilm_shape_computations_fold_to_constants():
    graph = optimized(minilm(batch=1, seq=128))
    leftover = sorted({n.op_type for n in graph.walk()} & {"Shape", "Size", "ConstantOfShape", "Range"})
    assert leftover == []
    # Every Reshape target and Expand shape is a constant now.
    for node in graph.walk():
        if node.op_type in ("Reshape", "Expand"):
            assert node.inputs[1].is_const, f"{node.describe()} still computes its shape"


def test_transformer_block_shape_computations_fold_to_constants():
    (case,) = [c for c in sample_models() if c.name == "transformer_block"]
    source_ops = {n.op_type for n in load_model(case.path).walk()}
    assert {"Shape", "Gather", "Concat", "Reshape"} <= source_ops  # the subgraph this test is about
    graph = optimized(case)
    assert [n for n in graph.walk() if n.op_type in ("Shape", "Gather", "Concat")] == []
    assert all(n.inputs[1].is_const for n in graph.walk() if n.op_type == "Reshape")


def test_binding_a_different_seq_gives_different_static_shapes():
    case = minilm(batch=1, seq=128)
    graph = inferred(case, input_shapes={}, dims={"batch": 2, "seq": 64})
    assert graph.outputs[0].shape == (2, 64, 384)
    assert values_without_static_shape(graph) == []


def actual_shapes(case: ModelCase, names: list[str]) -> dict[str, tuple[int, ...]]:
    """The shape of every named intermediate value when onnxruntime runs the original model."""
    model = onnx.load(case.path)
    declared = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in declared)
    return {name: tuple(value.shape) for name, value in run_onnxruntime(model, case.inputs).items()}


@pytest.mark.parametrize("name", [*SAMPLE_NAMES, "minilm"])
def test_inferred_shapes_are_the_shapes_onnxruntime_computes(name):
    case = minilm(batch=1, seq=128) if name == "minilm" else sample_model(name)
    graph = inferred(case)
    values = {out.name: out for node in graph.nodes for out in node.outputs if out.is_tensor}
    values.update({v.name: v for v in graph.constants()})
    names = [n.output[0] for n in onnx.load(case.path, load_external_data=False).graph.node
             if n.output and n.output[0] in values]
    assert len(names) >= len(graph.nodes) // 2  # most of the model is checked, not a handful
    actual = actual_shapes(case, names)
    wrong = [f"{n}: inferred {values[n].shape}, onnxruntime {actual[n]}" for n in names
             if values[n].shape != actual[n]]
    assert wrong == []
