"""Recurrent layers larger than --max-cu-size split into input projection (MatMul, split along its
output channels) and per-direction recurrence (cortex::<op>Recurrence), compile for wasm and
cuda-sim, and match onnxruntime; every CU keeps to the limit."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import cortex
from backends.cuda import toolchain as cuda_compile
from cortex.tools.onnx_reference import run_dag
from cortex.commands.decompose import decompose_model
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.partition import PartitionIntoCUs
from passes.split_large_ops import split_large_ops
from samples import recurrent
from testdata import ModelCase
from cuda_cases import compile_cuda_pipeline
from recurrent_cases import CASES, expected_outputs, layer_model
from wasm_cases import compile_pipeline, run_onnxruntime

DEFAULTS = {"min_cu_size": 256, "max_cu_size": 1_000_000, "max_cu_depth": 3}   # decompose's defaults
RTOL, ATOL = 1e-4, 1e-5


def manifest(dag_path) -> dict:
    return json.loads((dag_path.parent / "cus" / "manifest.json").read_text())


def cu_models(dag_path) -> list[onnx.ModelProto]:
    return [onnx.load(dag_path.parent / "cus" / cu["path"]) for cu in manifest(dag_path)["cus"]]


def check_dag(dag_path, inputs, expected, max_cu_size, device="wasm", rtol=RTOL, atol=ATOL, over_limit=0):
    """Each CU keeps to the limit, but for `over_limit` CUs that each hold one recurrence alone and
    say why, and is valid ONNX; the reference (onnxruntime per CU) and the compiled dag both match
    `expected`."""
    ops = set()
    over = []
    for cu, model in zip(manifest(dag_path)["cus"], cu_models(dag_path)):
        if "over_limit" in cu:
            over.append(cu)
            assert cu["params"] > max_cu_size and len(cu["nodes"]) == 1, cu
            assert [(n.domain, n.op_type) for n in model.graph.node][0][1].endswith("Recurrence"), cu
        else:
            assert cu["params"] <= max_cu_size, cu
        onnx.checker.check_model(model, full_check=True)
        ops.update((n.domain, n.op_type) for n in model.graph.node)
    assert len(over) == over_limit, over
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


def test_a_recurrence_larger_than_the_limit_is_left_whole_and_named_with_its_size():
    # hidden 512: one direction's R and B are 4 * 512 * 512 + 8 * 512 = 1,052,672 parameters
    graph = optimized(layer_model("LSTM", input_size=4, hidden=512, seq=2, batch=1, direction="forward")[0])
    oversized = {}
    assert split_large_ops(graph, 1_000_000, oversized) == 1
    (recurrence,) = [n for n in graph.nodes if n.domain == "cortex"]
    assert list(oversized) == [id(recurrence)]
    reason = oversized[id(recurrence)]
    assert "\n" not in reason and "1,052,672 parameters" in reason and "cannot be split" in reason


def test_an_ocr_bidirectional_lstm_of_hidden_512_decomposes_under_the_default_limits(tmp_path):
    """Each direction's recurrence (1,052,672 parameters) is a CU of its own over the limit, named in
    the manifest and the summary; the projections split to fit; the whole matches onnxruntime."""
    model, feeds = layer_model("LSTM", input_size=96, hidden=512, seq=4, batch=1, initial=True)
    path = tmp_path / "ocr_lstm.onnx"
    onnx.save(model, path)
    summary = decompose_model(path, tmp_path / "summary" / "cus", PartitionIntoCUs(**DEFAULTS))
    over = summary["over_limit_cus"]
    assert len(over) == 2 and all(o["params"] == 1_052_672 and "cannot be split" in o["reason"] for o in over.values())
    dag_path = compile_pipeline(path, tmp_path / "out", **DEFAULTS)
    check_dag(dag_path, feeds, run_onnxruntime(model, feeds), DEFAULTS["max_cu_size"], over_limit=2)
