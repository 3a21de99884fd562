"""Recurrent layers larger than --max-cu-size split into input projection (MatMul, split along its
output channels) and per-direction recurrence (cortex::<op>Recurrence), compile for wasm and
cuda-sim, and match onnxruntime; every CU keeps to the limit."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cortex
from backends.cuda import toolchain as cuda_compile
from cortex.runtime.onnx_reference import run_dag
from ir.errors import CortexError
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.split_large_ops import split_large_ops
from samples import recurrent
from testdata import ModelCase
from cuda_cases import compile_cuda_pipeline
from wasm_cases import compile_pipeline, make_model, run_onnxruntime

DEFAULTS = {"min_cu_size": 256, "max_cu_size": 1_000_000, "max_cu_depth": 3}   # decompose's defaults
RTOL, ATOL = 1e-4, 1e-5


def manifest(dag_path) -> dict:
    return json.loads((dag_path.parent / "cus" / "manifest.json").read_text())


def cu_models(dag_path) -> list[onnx.ModelProto]:
    return [onnx.load(dag_path.parent / "cus" / cu["path"]) for cu in manifest(dag_path)["cus"]]


def check_dag(dag_path, inputs, expected, max_cu_size, device="wasm", rtol=RTOL, atol=ATOL):
    """Each CU keeps to the limit and is valid ONNX; the reference (onnxruntime per CU) and the
    compiled dag both match `expected`."""
    ops = set()
    for cu, model in zip(manifest(dag_path)["cus"], cu_models(dag_path)):
        assert cu["params"] <= max_cu_size, cu
        onnx.checker.check_model(model, full_check=True)
        ops.update((n.domain, n.op_type) for n in model.graph.node)
    assert not ops & {("", "LSTM"), ("", "GRU"), ("", "RNN")}, ops
    assert any(domain == "cortex" for domain, _ in ops), ops
    for name, got in run_dag(dag_path, inputs).items():
        np.testing.assert_allclose(got, expected[name], rtol=rtol, atol=atol, err_msg=f"reference {name}")
    got = cortex.load(dag_path, device=device).run(inputs)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=f"{device} {name}")


# -- torch exports at realistic sizes, under the default limits ----------------------------------
@pytest.mark.parametrize("name", ["lstm", "gru", "rnn"])
def test_torch_recurrent_models_compile_under_the_default_limits(name, tmp_path):
    m = recurrent.recurrent(name)
    dag_path = compile_pipeline(m.path, tmp_path, input_shapes=m.input_shapes, **DEFAULTS)
    check_dag(dag_path, m.inputs, m.outputs, DEFAULTS["max_cu_size"])


# -- the attributes, on small layers under a small limit ------------------------------------------
def layer_model(op, input_size=12, hidden=8, seq=5, batch=3, direction="bidirectional", layout=0,
                lengths=False, initial=False, peepholes=False, only_y=False, **attrs):
    """One recurrent node with random constant weights; the model's inputs are X and, when asked,
    sequence_lens and the initial states."""
    rng = np.random.default_rng(3)
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    dirs = 2 if direction == "bidirectional" else 1
    x_shape = [batch, seq, input_size] if layout else [seq, batch, input_size]
    state_shape = [batch, dirs, hidden] if layout else [dirs, batch, hidden]
    inits = [helper.make_tensor(name, TensorProto.FLOAT, shape, (0.3 * rng.standard_normal(shape)).ravel())
             for name, shape in (("W", [dirs, gates * hidden, input_size]), ("R", [dirs, gates * hidden, hidden]),
                                 ("B", [dirs, 2 * gates * hidden]))]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    names = ["X", "W", "R", "B", "", "", "", ""]
    feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
    if lengths:
        inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, [batch]))
        names[4] = "lens"
        feeds["lens"] = rng.integers(1, seq + 1, batch).astype(np.int32)
    if initial:
        states = ["h0", "c0"] if op == "LSTM" else ["h0"]
        for i, state in enumerate(states):
            inputs.append(helper.make_tensor_value_info(state, TensorProto.FLOAT, state_shape))
            names[5 + i] = state
            feeds[state] = rng.standard_normal(state_shape).astype(np.float32)
    if peepholes:
        inits.append(helper.make_tensor("P", TensorProto.FLOAT, [dirs, 3 * hidden],
                                        (0.3 * rng.standard_normal(dirs * 3 * hidden))))
        names[7] = "P"
    outs = ["Y"] if only_y else ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    y_shape = [batch, seq, dirs, hidden] if layout else [seq, dirs, batch, hidden]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, y_shape if o == "Y" else state_shape)
               for o in outs]
    used = len(names) - next(i for i, n in enumerate(reversed(names)) if n)
    node = helper.make_node(op, names[:used], outs, hidden_size=hidden, direction=direction,
                            **({"layout": layout} if layout else {}), **attrs)
    return make_model([node], inputs, outputs, inits, opset=17), feeds


CASES = {
    "lstm-lengths-initial-peepholes": ("LSTM", {"lengths": True, "initial": True, "peepholes": True}),
    "lstm-layout1-clip": ("LSTM", {"layout": 1, "clip": 0.7, "initial": True}),
    "lstm-activations": ("LSTM", {"activations": ["HardSigmoid", "Tanh", "Softsign"] * 2,
                                  "activation_alpha": [0.3, 1.0, 1.0, 0.25, 1.0, 1.0],
                                  "activation_beta": [0.4, 0.0, 0.0, 0.6, 0.0, 0.0]}),
    "lstm-reverse": ("LSTM", {"direction": "reverse", "lengths": True}),
    "lstm-only-y": ("LSTM", {"only_y": True}),
    "gru-forward-only-y": ("GRU", {"direction": "forward", "only_y": True, "input_size": 24}),
    "gru-linear-before-reset": ("GRU", {"linear_before_reset": 1, "lengths": True, "initial": True}),
    "gru-reset-first-layout1": ("GRU", {"linear_before_reset": 0, "layout": 1, "initial": True}),
    "rnn-relu-clip": ("RNN", {"activations": ["Relu", "Tanh"], "clip": 2.0, "initial": True,
                              "input_size": 24, "hidden": 16}),
}


def expected_outputs(op, attrs, model, feeds):
    """onnxruntime's outputs; for a batch-major layer (which onnxruntime does not run), those of the
    same layer time-major, on the transposed inputs, transposed back."""
    if not attrs.get("layout"):
        return run_onnxruntime(model, feeds)
    time_major, _ = layer_model(op, **{**attrs, "layout": 0})
    turned = {k: v.transpose(1, 0, 2) if v.ndim == 3 else v for k, v in feeds.items()}
    return {k: v.transpose(2, 0, 1, 3) if v.ndim == 4 else v.transpose(1, 0, 2)
            for k, v in run_onnxruntime(time_major, turned).items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_small_layers_split_under_a_small_limit_match_onnxruntime(case, tmp_path):
    op, attrs = CASES[case]
    model, feeds = layer_model(op, **attrs)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    limit = 700   # below one layer, above one direction's recurrence and projection
    dag_path = compile_pipeline(path, tmp_path / "out", min_cu_size=64, max_cu_size=limit, max_cu_depth=3)
    check_dag(dag_path, feeds, expected_outputs(op, attrs, model, feeds), limit)


def test_cuda_sim_runs_a_split_lstm(tmp_path):
    if cuda_compile.find_nvcc() is None and cuda_compile.nvrtc_version() is None:
        pytest.skip("neither nvcc nor NVRTC is installed")
    model, feeds = layer_model("LSTM", lengths=True, initial=True)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    case = ModelCase("lstm", path, feeds, run_onnxruntime(model, feeds))
    dag_path = compile_cuda_pipeline(case, tmp_path / "out", min_cu_size=64, max_cu_size=700, max_cu_depth=3)
    check_dag(dag_path, feeds, case.outputs, 700, device="cuda-sim")


# -- when the split happens, and when it cannot ----------------------------------------------------
def optimized(model):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return graph


def test_a_layer_under_the_limit_is_left_as_it_was():
    graph = optimized(layer_model("LSTM")[0])
    assert split_large_ops(graph, 1_000_000) == 0
    assert [n.op_type for n in graph.nodes] == ["LSTM"]
    assert not graph.functions and "cortex" not in graph.opset_imports


def test_a_split_layer_is_a_projection_and_a_recurrence_per_direction():
    graph = optimized(layer_model("GRU", lengths=True)[0])
    assert split_large_ops(graph, 700) == 1
    ops = sorted((n.domain, n.op_type) for n in graph.nodes)
    assert ops == [("", "Concat"), ("", "Concat"), ("", "MatMul"), ("", "MatMul"),
                   ("cortex", "GRURecurrence"), ("cortex", "GRURecurrence")]
    assert {n.attrs["direction"] for n in graph.nodes if n.domain == "cortex"} == {"forward", "reverse"}
    assert [(f.domain, f.name) for f in graph.functions] == [("cortex", "GRURecurrence")]


def test_a_recurrence_larger_than_the_limit_is_one_line_naming_the_size_it_needs():
    # hidden 512: one direction's R alone is 4 * 512 * 512 = 1,048,576 parameters
    graph = optimized(layer_model("LSTM", input_size=4, hidden=512, seq=2, batch=1, direction="forward")[0])
    with pytest.raises(CortexError) as error:
        split_large_ops(graph, 1_000_000)
    message = str(error.value)
    assert "\n" not in message and "raise --max-cu-size to at least 1,052,672" in message
