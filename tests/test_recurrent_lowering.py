"""Recurrent layers lowered whole (not split): the input projection over all steps (one GEMM where
the target offers one), then per step the recurrent product of every batch row and the gate update,
match onnxruntime on every attribute, at every wasm feature set and opt level (kernels or plain
loops), with constant weights or weights given as inputs, and on cuda-sim."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import cortex
from backends.cuda import toolchain as cuda_compile
from ir.onnx_import import import_model
from ir.ops import recurrent
from cuda_cases import compile_cuda_pipeline
from recurrent_cases import CASES, expected_outputs, layer_model
from testdata import ModelCase
from wasm_cases import CONFIGS, run_onnxruntime, run_wasm

RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_layers_match_onnxruntime_at_every_feature_set(case):
    op, attrs = CASES[case]
    model, feeds = layer_model(op, **attrs)
    expected = expected_outputs(op, attrs, model, feeds)
    for features, level in CONFIGS:
        got = run_wasm(model, feeds, features, level)
        assert sorted(got) == sorted(expected)
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=f"{case} {name} {features} {level}")


@pytest.mark.parametrize("op,attrs", [("GRU", {"linear_before_reset": 0, "batch": 1, "lengths": True}),
                                      ("LSTM", {"batch": 2, "initial": True, "peepholes": True})])
def test_weights_given_as_inputs_match_onnxruntime(op, attrs):
    """W, R and B as model inputs: no packing at compile time, the plain loops compute the products."""
    model, feeds = layer_model(op, **attrs)
    expected = expected_outputs(op, attrs, model, feeds)
    for init in list(model.graph.initializer):
        model.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        feeds[init.name] = onnx.numpy_helper.to_array(init)
    del model.graph.initializer[:]
    got = run_wasm(model, feeds, "simd,relaxed-simd", "3")
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("case", ["gru-reset-first-layout1", "lstm-lengths-initial-peepholes", "rnn-relu-clip"])
def test_cuda_sim_runs_whole_layers(case, tmp_path):
    if cuda_compile.find_nvcc() is None and cuda_compile.nvrtc_version() is None:
        pytest.skip("neither nvcc nor NVRTC is installed")
    op, attrs = CASES[case]
    model, feeds = layer_model(op, **attrs)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    expected = expected_outputs(op, attrs, model, feeds)
    dag_path = compile_cuda_pipeline(ModelCase(case, path, feeds, expected), tmp_path / "out")
    got = cortex.load(dag_path, device="cuda-sim").run(feeds)
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_saturated_gates_match_onnxruntime(op):
    """Inputs large enough to drive the gates deep into saturation (pre-activations far past the
    clamps of the rational sigmoid and tanh) and across zero."""
    model, feeds = layer_model(op, initial=True)
    feeds["X"] = feeds["X"] * 40.0
    feeds["X"][0] = 1e-4
    expected = run_onnxruntime(model, feeds)
    for features, level in [("simd,relaxed-simd", "3"), ("", "2")]:
        got = run_wasm(model, feeds, features, level)
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=f"{op} {name} {features}")


@pytest.mark.parametrize("case", ["lstm-lengths-initial-peepholes", "gru-linear-before-reset", "gru-reset-first-layout1"])
def test_products_a_gate_at_a_time_in_alternating_order_match_onnxruntime(case, monkeypatch):
    """An R over the L2 budget is multiplied a gate at a time, odd steps walking the gates backwards:
    with the budget at 0 every layer of more than one gate takes that path."""
    monkeypatch.setattr(recurrent, "L2_BYTES", 0)
    op, attrs = CASES[case]
    model, feeds = layer_model(op, **attrs)
    node = import_model(model).nodes[0]
    gates = recurrent.GATES[op] - (1 if op == "GRU" and not attrs.get("linear_before_reset") else 0)
    assert len(recurrent._product_parts(recurrent._layer(node, op, False, node.inputs[0].shape), gates)) == gates
    expected = expected_outputs(op, attrs, model, feeds)
    got = run_wasm(model, feeds, "simd,relaxed-simd", "3")
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=f"{case} {name}")
