"""The conformance harness (`make conformance`): representative node tests pass through the whole
pipeline, and every case lands in the right class, with the table saying what happened.

The full run over every node test is `make conformance`; here a fixed subset covers the op families
most models use. Node tests that feed op parameters (Slice starts/ends, ReduceSum axes) as graph
inputs pass once those are frozen (test_parameter_inputs_are_frozen_after_the_constant_refusal).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import onnx
import pytest

from bench.conformance import __main__ as conformance_cli
from bench.conformance import pool
from bench.conformance.cases import case_op, describe_case, parameter_inputs
from bench.conformance.devices import unavailable_reason
from bench.conformance.run_case import CaseResult, compare_outputs, run_case
from bench.conformance.table import render_markdown, summarize
from samples.node_tests import NODE_TESTS_DIR, ensure_node_tests, load_node_test

REPRESENTATIVE = [
    # elementwise, with broadcasting
    "test_add_bcast", "test_mul_bcast", "test_div_bcast", "test_relu", "test_sigmoid", "test_where_example",
    # contractions
    "test_matmul_3d", "test_gemm_all_attributes",
    # convolution and pooling
    "test_conv_with_strides_padding", "test_conv_with_autopad_same", "test_maxpool_2d_pads",
    "test_averagepool_2d_strides", "test_globalaveragepool",
    # reductions
    "test_reduce_max_default_axes_keepdims_random", "test_argmax_keepdims_example",
    # softmax, direct and as its function body
    "test_softmax_axis_1", "test_logsoftmax_axis_1_expanded",
    # layout
    "test_reshape_negative_dim", "test_transpose_all_permutations_3", "test_concat_3d_axis_1",
    "test_gather_2d_indices",
]
META = {"device": "wasm", "commit": "abc1234", "date": "2026-01-01 00:00 UTC", "command": "make conformance"}


def model_of(name: str) -> onnx.ModelProto:
    ensure_node_tests()
    return onnx.load(NODE_TESTS_DIR / name / "model.onnx", load_external_data=False)


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_representative_node_tests_pass_through_cortex(name):
    result = run_case(name, "wasm")
    assert result.outcome == "passed", f"{result.outcome} at {result.stage}: {result.why}"


@pytest.mark.skipif(unavailable_reason("cuda-sim") is not None, reason="the cuda-sim device is not available here")
def test_a_node_test_passes_on_cuda_sim():
    result = run_case("test_relu", "cuda-sim")
    assert result.outcome == "passed", f"{result.outcome} at {result.stage}: {result.why}"


def test_a_case_cortex_refuses_is_unsupported_with_its_reason():
    # The window's size decides the shape of the Range inside the expanded body, but it is the
    # model's only input: freezing it would fold the whole computation away, so the refusal stands.
    result = run_case("test_hannwindow_expanded", "wasm")
    assert (result.outcome, result.stage) == ("unsupported", "decompose")
    assert "Range" in result.why and "cannot infer a static shape" in result.why
    assert "frozen_parameters" not in result.extra


@pytest.mark.parametrize("name, frozen", [
    ("test_slice", ["axes", "ends", "starts", "steps"]),
    ("test_reduce_sum_default_axes_keepdims_example", ["axes"]),
    # refused for a shape it cannot infer, not for a constant a lowering needs
    ("test_reduce_l2_default_axes_keepdims_example_expanded", ["axes"]),
    ("test_center_crop_pad_crop", ["shape"]),
    # a float input that decides the output's shape
    ("test_resize_upsample_scales_linear", ["scales"]),
])
def test_parameter_inputs_are_frozen_after_the_constant_refusal(name, frozen):
    result = run_case(name, "wasm")
    assert result.outcome == "passed", f"{result.outcome} at {result.stage}: {result.why}"
    assert result.extra["frozen_parameters"] == frozen
    assert result.to_json()["extra"] == {"frozen_parameters": frozen}


@pytest.mark.parametrize("name", ["test_onehot_with_axis", "test_range_float_type_positive_delta",
                                  "test_hannwindow", "test_melweightmatrix"])
def test_shape_parameters_of_a_static_output_are_read_at_run_time(name):
    result = run_case(name, "wasm")
    assert result.outcome == "passed", f"{result.outcome} at {result.stage}: {result.why}"
    assert "frozen_parameters" not in result.extra


def test_only_integer_inputs_never_read_as_data_are_parameters():
    assert parameter_inputs(model_of("test_slice")) == ["starts", "ends", "axes", "steps"]
    assert parameter_inputs(model_of("test_resize_downsample_scales_cubic")) == []   # float scales, roi
    assert parameter_inputs(model_of("test_reshape_negative_dim")) == ["shape"]
    assert parameter_inputs(model_of("test_mod_int64_fmod")) == ["y"]             # x is read as input 0
    assert parameter_inputs(model_of("test_add_bcast")) == []


def case_inputs(name: str) -> dict:
    return load_node_test(name).inputs


@pytest.mark.parametrize("name, parameters", [
    ("test_resize_downsample_scales_cubic", ["scales"]),     # float, but it decides Y's shape; roi does not
    ("test_onehot_with_axis", ["depth"]),                    # not the indices, not the on/off values
    ("test_hannwindow", ["x"]),                              # the size, read as input 0
    ("test_affine_grid_2d_expanded", ["size"]),              # read as input 0 in a branch, decided by folding
    ("test_range_float_type_positive_delta", ["start", "limit", "delta"]),
    ("test_matmul_2d", []),                                  # only their shapes matter
    ("test_add_bcast", []),
])
def test_inputs_whose_value_decides_a_shape_are_parameters(name, parameters):
    assert parameter_inputs(model_of(name), case_inputs(name)) == parameters


def test_the_header_counts_passes_that_needed_frozen_parameters():
    results = [CaseResult("test_a", "Slice", "passed", extra={"frozen_parameters": ["starts"]}),
               CaseResult("test_b", "Slice", "passed"),
               CaseResult("test_c", "Resize", "unsupported", "must be a constant", extra={"frozen_parameters": ["x"]})]
    text = render_markdown(results, META)
    assert "- Frozen parameters: 1 of the passing cases" in text
    assert "an input of any dtype whose value decides an output's shape" in text
    assert "- Without frozen parameters: 1 of 3 cases pass with every input fed at run time (33.3%)." in text
    assert summarize(results)["passed_unfrozen"] == 1


def test_the_op_of_a_case_comes_from_its_graph():
    assert case_op(model_of("test_softmax_axis_0")) == "Softmax"
    assert case_op(model_of("test_softmax_axis_0_expanded")) == "Softmax (expanded)"
    # the expansions onnx keeps for older opsets carry the same function-body value names
    assert case_op(model_of("test_relu_expanded_ver18")) == "Relu (expanded)"


@pytest.mark.parametrize("name, why", [
    ("test_adam", "training op"),
    ("test_batchnorm_epsilon_training_mode", "training op"),
    ("test_training_dropout", "random outputs"),
    ("test_bernoulli", "random outputs"),
    ("test_string_concat", "string tensors"),
    ("test_sequence_insert_at_back", "sequence values"),
    ("test_optional_get_element_optional_sequence", "optional values"),
])
def test_training_string_sequence_and_random_cases_are_out_of_scope(name, why):
    assert why in (describe_case(model_of(name)).out_of_scope or "")


def test_ordinary_cases_are_in_scope():
    for name in REPRESENTATIVE[:5]:
        assert describe_case(model_of(name)).out_of_scope is None, name


def test_a_wrong_result_is_reported_with_its_largest_errors():
    expected = {"y": np.array([1.0, 2.0, 4.0], np.float32)}
    assert compare_outputs("test_x", {"y": expected["y"] * (1 + 5e-4)}, expected) is None   # within rtol 1e-3
    why, abs_err, rel_err = compare_outputs("test_x", {"y": np.array([1.0, 2.0, 4.5], np.float32)}, expected)
    assert (abs_err, rel_err) == (0.5, 0.125)
    assert "1 of 3 values off" in why
    assert "dtype float64" in compare_outputs("test_x", {"y": expected["y"].astype(np.float64)}, expected)[0]
    assert "shape [1, 3]" in compare_outputs("test_x", {"y": expected["y"][None]}, expected)[0]


def test_half_precision_gets_two_ulps():
    expected = {"y": np.array([1.0], np.float16)}
    two_ulps = np.array([1.0 + 2 * 2**-10], np.float16)
    three_ulps = np.array([1.0 + 3 * 2**-10], np.float16)
    assert compare_outputs("test_x", {"y": two_ulps}, expected) is None
    assert compare_outputs("test_x", {"y": three_ulps}, expected) is not None


def test_cases_run_in_parallel_in_the_order_given():
    names = ["test_relu", "test_adam", "test_sigmoid", "test_slice"]
    results = pool.run_cases(names, "wasm", jobs=2, timeout=60)
    assert [r.name for r in results] == names
    assert [r.outcome for r in results] == ["passed", "out-of-scope", "passed", "passed"]


def hang(name, device):
    time.sleep(60)


def die(name, device):
    os._exit(3)


def test_a_case_over_the_time_limit_is_killed_and_recorded_as_crashed():
    start = time.monotonic()
    (result,) = pool.run_cases(["test_relu"], "wasm", jobs=1, timeout=1, run=hang)
    assert time.monotonic() - start < 20
    assert (result.outcome, result.op) == ("crashed", "Relu")
    assert "timed out after 1 s" in result.why


def test_a_case_that_kills_its_process_is_recorded_as_crashed():
    (result,) = pool.run_cases(["test_relu"], "wasm", jobs=1, timeout=30, run=die)
    assert result.outcome == "crashed" and "exit code 3" in result.why


def test_headline_counts_only_cases_onnxruntime_passes():
    results = [CaseResult("test_a", "Relu", "passed"), CaseResult("test_b", "Relu", "failed", "off"),
               CaseResult("test_c", "Conv", "unsupported", "no lowering"), CaseResult("test_d", "Conv", "passed"),
               CaseResult("test_e", "Cast", "ort-cannot-run", "onnxruntime cannot run it: x"),
               CaseResult("test_f", "Adam", "out-of-scope", "training op (Adam)")]
    summary = summarize(results)
    assert (summary["counted"], summary["passed"], summary["pass_rate"]) == (4, 2, 0.5)
    text = render_markdown(results, META)
    assert "2 of 4 cases that onnxruntime passes pass through Cortex (50.0%)" in text
    assert "| Conv | 2 | 1 | 0 | 1 | 0 | unsupported: no lowering" in text
    assert "| Relu | 2 | 1 | 1 | 0 | 0 | failed: off" in text
    assert "| **total** | **4** | **2** | **1** | **1** | **0** | |" in text
    assert "test_e" in text and "test_f" in text and "| Adam |" not in text and "| Cast |" not in text


def test_a_device_that_is_not_available_says_so_in_the_header():
    assert "unknown device" in unavailable_reason("tpu")
    text = render_markdown([], {**META, "device": "cuda-sim", "unavailable": "'cortex compile-cuda' not available yet"})
    assert "Device cuda-sim is not available yet: 'cortex compile-cuda' not available yet" in text


def test_the_command_writes_the_table_and_its_json(tmp_path, capsys):
    output = tmp_path / "conformance.md"
    assert conformance_cli.main(["--cases", "^test_(relu|adam)$", "--output", str(output)]) == 0
    text = output.read_text()
    assert "1 of 1 cases that onnxruntime passes pass through Cortex (100.0%)" in text
    assert "| Relu | 1 | 1 | 0 | 0 | 0 |  |" in text
    document = json.loads(output.with_suffix(".json").read_text())
    assert document["schema"] == "bench.conformance/1" and document["device"] == "wasm"
    assert {c["name"]: c["outcome"] for c in document["cases"]} == {"test_adam": "out-of-scope", "test_relu": "passed"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conformance.json", "conformance.md"]  # no temporaries left
