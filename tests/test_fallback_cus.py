"""Fallback CUs (`cortex decompose --fallback onnxruntime`): nodes no target lowers go into CUs of
their own, which the compile commands skip and the scheduler runs on the onnxruntime device; the
rest is compiled and runs on the model's device, tensors crossing at the borders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import cortex
from backends.registry import target
from bench.conformance.devices import unavailable_reason
from cli_helpers import assert_one_line_error, run_cli
from codegen.lower import unsupported_nodes
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from ir.errors import CortexError
from ir.fs import write_bytes_atomically
from ir.onnx_import import import_model
from ir.options import from_text
from passes.partition import PartitionIntoCUs
from test_partition import assert_valid_partition, partitioned, random_model
from testdata import assert_values_close, run_onnxruntime

WIDTH = 8


def mixed_model() -> onnx.ModelProto:
    """MatMul -> Relu -> Cast -> TfIdfVectorizer -> Tanh -> Add(a ReduceMean of the Relu's output),
    and the TfIdfVectorizer's counts as a second model output. Cortex does not lower
    TfIdfVectorizer; the Add reads both sides, so a CU holding the Relu and the Add around the
    fallback CU would not be convex."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) * 3).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="matmul"),
        helper.make_node("Relu", ["a"], ["b"], name="relu"),
        helper.make_node("Cast", ["b"], ["ints"], name="cast", to=TensorProto.INT64),
        helper.make_node("TfIdfVectorizer", ["ints"], ["counts"], name="count_ngrams", mode="TF", min_gram_length=1,
                         max_gram_length=1, max_skip_count=0, ngram_counts=[0], ngram_indexes=[0, 1, 2],
                         pool_int64s=[1, 2, 3]),
        helper.make_node("Tanh", ["counts"], ["t"], name="tanh"),
        helper.make_node("ReduceMean", ["b", "axes"], ["mean"], name="mean", keepdims=1),
        helper.make_node("Add", ["t", "mean"], ["y"], name="add"),
    ]
    graph = helper.make_graph(nodes, "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3]),
                               helper.make_tensor_value_info("counts", TensorProto.FLOAT, [4, 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((4, WIDTH)).astype(np.float32)}


@pytest.fixture
def model_path(tmp_path) -> Path:
    path = tmp_path / "mixed.onnx"
    onnx.save(mixed_model(), path)
    return path


def decompose_and_build(model_path: Path, out: Path) -> Path:
    decompose_model(model_path, out / "cus", PartitionIntoCUs(fallback="onnxruntime"))
    dag_path = out / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out / "cus", dag_path), indent=2).encode())
    return dag_path


def test_tfidf_vectorizer_has_no_lowering():
    graph = import_model(mixed_model())
    assert [n.op_type for n in unsupported_nodes(graph)] == ["TfIdfVectorizer"]


def test_without_the_flag_compile_wasm_fails_in_one_line_suggesting_it(model_path, tmp_path):
    code, _, err = run_cli(["decompose", "--model-path", model_path, "--output-dir", tmp_path / "cus"])
    assert code == 0, err
    manifest = json.loads((tmp_path / "cus" / "manifest.json").read_text())
    assert "fallback" not in manifest["options"] and all("runs_on" not in cu for cu in manifest["cus"])
    code, _, err = run_cli(["compile-wasm", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "wasm-bin"])
    assert_one_line_error(code, err, "cannot compile to wasm", "TfIdfVectorizer (count_ngrams)", "--fallback onnxruntime")


def test_fallback_cus_run_on_onnxruntime_and_the_rest_on_wasm_from_the_cli(model_path, tmp_path):
    cus, dag_path = tmp_path / "cus", tmp_path / "dag.json"
    code, out, err = run_cli(["decompose", "--model-path", model_path, "--output-dir", cus,
                              "--fallback", "onnxruntime", "--json"])
    assert code == 0, err
    summary = json.loads(out)
    manifest = json.loads((cus / "manifest.json").read_text())
    assert manifest["options"]["fallback"] == "onnxruntime"
    fallback = [cu for cu in manifest["cus"] if cu.get("runs_on") == "onnxruntime"]
    assert [cu["op_types"] for cu in fallback] == [["TfIdfVectorizer"]]
    assert summary["fallback_cus"] == {"onnxruntime": [cu["id"] for cu in fallback]}
    assert all(cu.get("runs_on") is None for cu in manifest["cus"] if set(cu["op_types"]) & {"MatMul", "Add"})

    code, _, err = run_cli(["build-dag", "--cu-dir", cus, "--output", dag_path])
    assert code == 0, err
    code, out, err = run_cli(["compile-wasm", "--cu-dir", cus, "--output", tmp_path / "wasm-bin",
                              "--dag", dag_path, "--json"])
    assert code == 0, err
    compiled = json.loads(out)
    assert compiled["fallback_cus"] == 1 and compiled["cus"] == len(manifest["cus"]) - 1
    dag = json.loads(dag_path.read_text())
    for cu in dag["cus"]:
        assert ("wasm" in cu["artifacts"]) == ("runs_on" not in cu)
    assert not (tmp_path / "wasm-bin" / f"{fallback[0]['id']}.wasm").exists()

    np.savez(tmp_path / "in.npz", **feeds())
    code, out, err = run_cli(["run", dag_path, "--input", tmp_path / "in.npz", "--output", tmp_path / "out.npz",
                              "--trace", tmp_path / "trace.json"])
    assert code == 0, err
    assert "(1 on onnxruntime: fallback)" in out
    got = dict(np.load(tmp_path / "out.npz"))
    assert_values_close(got, run_onnxruntime(model_path, feeds()), rtol=1e-5, atol=1e-6)
    trace = json.loads((tmp_path / "trace.json").read_text())
    ran_on = {entry["cu"]: entry["device"] for entry in trace["cus"]}
    assert ran_on == {cu["id"]: cu.get("runs_on", "wasm") for cu in dag["cus"]}
    assert trace["cus_by_device"] == {"wasm": len(dag["cus"]) - 1, "onnxruntime": 1}
    # The fallback CU reads the Relu's output from a wasm CU: it crossed a border.
    assert next(e for e in trace["cus"] if e["device"] == "onnxruntime")["bytes_from_other_devices"] > 0


@pytest.mark.skipif(unavailable_reason("cuda-sim") is not None, reason="the cuda-sim device is not available here")
def test_fallback_cus_around_cuda_sim_cus(model_path, tmp_path):
    dag_path = decompose_and_build(model_path, tmp_path)
    compile_cu_dir(target("cuda"), tmp_path / "cus", tmp_path / "cuda-bin",
                   from_text(target("cuda").options, compiler="nvrtc"), dag_path, jobs=1)
    model = cortex.load(dag_path, device="cuda-sim")
    assert_values_close(model.run(feeds()), run_onnxruntime(model_path, feeds()), rtol=1e-5, atol=1e-6)
    assert {t["device"] for t in model.trace} == {"cuda-sim", "onnxruntime"}


def test_the_whole_dag_runs_on_the_onnxruntime_device(model_path, tmp_path):
    dag_path = decompose_and_build(model_path, tmp_path)
    model = cortex.load(dag_path, device="onnxruntime")   # nothing compiled: every cu.onnx as it is
    assert_values_close(model.run(feeds()), run_onnxruntime(model_path, feeds()), rtol=1e-5, atol=1e-6)
    assert {t["device"] for t in model.trace} == {"onnxruntime"}
    assert all(t["bytes_from_other_devices"] == 0 for t in model.trace)


def test_a_fallback_cu_whose_file_differs_from_dag_json_is_refused(model_path, tmp_path):
    dag_path = decompose_and_build(model_path, tmp_path)
    compile_cu_dir(target("wasm"), tmp_path / "cus", tmp_path / "wasm-bin", from_text(target("wasm").options),
                   dag_path, jobs=1)
    dag = json.loads(dag_path.read_text())
    fallback = next(cu for cu in dag["cus"] if cu.get("runs_on") == "onnxruntime")
    path = tmp_path / fallback["path"]
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(CortexError, match=r"sha256 differs from .*dag\.json.*modified or stale") as info:
        cortex.load(dag_path, device="wasm")
    assert "\n" not in str(info.value) and fallback["id"] in str(info.value)


def test_a_fallback_cu_whose_path_leaves_the_folder_of_dag_json_is_refused(model_path, tmp_path):
    dag_path = decompose_and_build(model_path, tmp_path)
    dag = json.loads(dag_path.read_text())
    fallback = next(cu for cu in dag["cus"] if cu.get("runs_on") == "onnxruntime")
    fallback["path"] = "../elsewhere/cu.onnx"
    dag_path.write_text(json.dumps(dag))
    with pytest.raises(CortexError, match="runs on onnxruntime.*leaves the folder of dag.json"):
        cortex.load(dag_path, device="onnxruntime")


def test_an_unknown_runs_on_is_refused_by_the_schema(model_path, tmp_path):
    dag_path = decompose_and_build(model_path, tmp_path)
    dag = json.loads(dag_path.read_text())
    dag["cus"][0]["runs_on"] = "tpu"
    dag_path.write_text(json.dumps(dag))
    with pytest.raises(CortexError, match=r"schema at cus\[0\]\.runs_on"):
        cortex.load(dag_path, device="onnxruntime")


def test_without_fallback_nodes_the_flag_changes_no_cu(tmp_path):
    model = random_model(3, 20)
    plain, flagged = tmp_path / "plain.onnx", tmp_path / "flagged.onnx"
    onnx.save(model, plain)
    decompose_model(plain, tmp_path / "a")
    decompose_model(plain, tmp_path / "b", PartitionIntoCUs(fallback="onnxruntime"))
    a = json.loads((tmp_path / "a" / "manifest.json").read_text())
    b = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [cu["sha256"] for cu in a["cus"]] == [cu["sha256"] for cu in b["cus"]]
    assert all("runs_on" not in cu for cu in b["cus"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_nodes=st.integers(2, 50), max_cu_depth=st.integers(1, 5),
       min_cu_size=st.sampled_from([0, 64, 10_000]), marked=st.integers(1, 6))
def test_random_fallback_nodes_never_share_a_cu_with_compiled_ones(seed, n_nodes, max_cu_depth, min_cu_size, marked):
    """Any set of nodes may be the fallback: CUs stay convex and within the limits, and each is
    all fallback (marked to run on onnxruntime) or all compiled."""
    def cannot_lower(graph):
        return [n for i, n in enumerate(graph.nodes) if (i * 7 + seed) % marked == 0]

    chosen: set[int] = set()

    def recording(graph):
        nodes = cannot_lower(graph)
        chosen.update(id(n) for n in nodes)
        return nodes

    graph, part = partitioned(random_model(seed, n_nodes), min_cu_size=min_cu_size, max_cu_size=None,
                              max_cu_depth=max_cu_depth, fallback="onnxruntime", cannot_lower=recording)
    assert_valid_partition(graph, part, None, max_cu_depth)
    # A fusion group is never cut: one fallback node takes its whole group along.
    groups = {n.fusion_group for n in graph.nodes if id(n) in chosen and n.fusion_group is not None}
    chosen |= {id(n) for n in graph.nodes if n.fusion_group in groups}
    for cu in part.cus:
        kinds = {id(n) in chosen for n in cu.nodes}
        assert len(kinds) == 1, "a CU mixes fallback and compiled nodes"
        assert (cu.runs_on == "onnxruntime") == kinds.pop()
