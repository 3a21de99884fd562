"""Import -> passes -> export keeps a model valid and its results unchanged.

Every model is compared with itself under onnxruntime: the original against the exported one, on
the same feed. Import -> export without passes must be bit-exact, and so must the optimisation
pipeline unless it folded floating-point values (a folded value is computed once, possibly in a
different order): then the results must agree to rtol 1e-5, atol 1e-6.
Node tests that onnxruntime itself cannot run or gets wrong are skipped, with the reason.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

from ir.onnx_export import export_model
from ir.onnx_import import load_model
from passes import optimize_pipeline, run_pipeline
from testdata import (ModelCase, assert_bit_exact, assert_values_close, light_model, light_model_params, minilm,
                      minilm_feed, node_test_case, node_test_names, onnxruntime_reproduces, run_onnxruntime,
                      sample_model, sample_models)

RTOL, ATOL = 1e-5, 1e-6
# Half-precision results get 2 ulps: onnxruntime's fp16 Mul rounds differently when one operand is
# an initializer rather than a computed value (measured on test_attention_4d_fp16_expanded: 1 ulp
# after folding the scale to a constant; the folded result is the correctly rounded one).
HALF_RTOL, HALF_ATOL = 2e-3, 1e-5
SKIP_PREFIX = "onnxruntime cannot reproduce this node test: "


def assert_checker_accepts(model: onnx.ModelProto, case: ModelCase) -> None:
    """Full check, unless the checker also rejects the original: for a few node tests (test_mvn) the
    checker's function expansion fails on the model onnx itself ships, so it says nothing about us."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        try:
            onnx.checker.check_model(onnx.load(case.path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
            return
        raise


def exported_without_passes(case: ModelCase) -> onnx.ModelProto:
    model = export_model(load_model(case.path))
    assert_checker_accepts(model, case)
    return model


def exported_after_pipeline(case: ModelCase, input_shapes=None) -> tuple[onnx.ModelProto, bool]:
    """The optimised model, and whether folding computed new floating-point constants (the only
    pass that may change results: a folded value is computed once, in a different order)."""
    shapes = case.input_shapes if input_shapes is None else input_shapes
    source_constants = {v.name for v in load_model(case.path).constants()}
    graph, _ = run_pipeline(load_model(case.path), optimize_pipeline(shapes, case.dims))
    model = export_model(graph)
    assert_checker_accepts(model, case)
    folded_floats = any(v.name not in source_constants and v.const.dtype.kind in "fcV"
                        for g in [graph, *(s for n in graph.walk() for s in n.subgraphs)] for v in g.constants())
    return model, folded_floats


def assert_same_results(case: ModelCase, model: onnx.ModelProto, bit_exact: bool) -> None:
    original = run_onnxruntime(case.path, case.inputs)
    exported = run_onnxruntime(model, case.inputs)
    assert list(exported) == list(original), "the exported model renamed or reordered its outputs"
    for name, expected in original.items():
        if bit_exact:
            assert_bit_exact(exported[name], expected)
        elif getattr(expected, "dtype", None) in (np.float16, ml_dtypes.bfloat16):
            assert_values_close(exported[name], expected, HALF_RTOL, HALF_ATOL)
        else:
            assert_values_close(exported[name], expected, RTOL, ATOL)


def tensor_input_shapes(case: ModelCase) -> dict[str, tuple[int, ...]]:
    """Bind every tensor input to the shape it is fed with (node tests declare few dynamic dims)."""
    return {name: tuple(v.shape) for name, v in case.inputs.items() if hasattr(v, "shape")}


# -- ONNX backend node tests ----------------------------------------------------------------------
@pytest.mark.parametrize("name", node_test_names())
def test_node_test_survives_import_export_and_the_pipeline(name):
    case = node_test_case(name)
    reason = onnxruntime_reproduces(case)
    if reason:
        pytest.skip(SKIP_PREFIX + reason)
    assert_same_results(case, exported_without_passes(case), bit_exact=True)
    model, folded_floats = exported_after_pipeline(case, tensor_input_shapes(case))
    assert_same_results(case, model, bit_exact=not folded_floats)


# -- sample, light and MiniLM models --------------------------------------------------------------
@pytest.mark.parametrize("case", sample_models(), ids=str)
def test_sample_model_round_trips_bit_exact(case):
    assert_same_results(case, exported_without_passes(case), bit_exact=True)


@pytest.mark.parametrize("case", sample_models(), ids=str)
def test_sample_model_keeps_its_results_through_the_pipeline(case):
    model, folded_floats = exported_after_pipeline(case)
    assert_same_results(case, model, bit_exact=not folded_floats)


@pytest.mark.parametrize("name", light_model_params())
def test_light_model_round_trips_bit_exact(name):
    case = light_model(name)
    assert_same_results(case, exported_without_passes(case), bit_exact=True)


@pytest.mark.parametrize("name", light_model_params())
def test_light_model_keeps_its_results_through_the_pipeline(name):
    case = light_model(name)
    model, folded_floats = exported_after_pipeline(case)
    assert_same_results(case, model, bit_exact=not folded_floats)
    assert_values_close(run_onnxruntime(model, case.inputs), case.outputs, RTOL, ATOL)


def test_minilm_round_trips_bit_exact():
    case = minilm(seq=128)
    assert_same_results(case, exported_without_passes(case), bit_exact=True)


def test_minilm_keeps_its_results_through_the_pipeline():
    case = minilm(seq=128)
    model, folded_floats = exported_after_pipeline(case)
    assert_same_results(case, model, bit_exact=not folded_floats)


def test_pipeline_without_bound_dims_keeps_minilm_dynamic():
    """Folding must not bake the first shape it sees into a model whose dims are left free."""
    case = minilm(seq=128)
    graph, _ = run_pipeline(load_model(case.path), optimize_pipeline())
    model = export_model(graph)
    onnx.checker.check_model(model, full_check=True)
    for batch, seq in [(1, 128), (2, 40)]:
        feed = minilm_feed(batch, seq)
        (got,) = run_onnxruntime(model, feed).values()
        (expected,) = run_onnxruntime(case.path, feed).values()
        assert got.shape == (batch, seq, 384)
        assert_bit_exact(got, expected)


@pytest.mark.parametrize("name", ["transformer_block", "minilm"])
def test_pipeline_output_is_byte_identical_across_runs(name):
    case = minilm(seq=128) if name == "minilm" else sample_model(name)
    first, _ = exported_after_pipeline(case)
    second, _ = exported_after_pipeline(case)
    assert first.SerializeToString() == second.SerializeToString()
