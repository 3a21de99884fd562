"""Run policies: strict runs exactly what the runtime ran before policies; requested outputs run
only the CUs upstream of them; offline runs the recorded source model on onnxruntime; every
policy's trace follows cortex/schemas/trace.schema.json."""

from __future__ import annotations

import json
import shutil

import jsonschema
import networkx as nx
import numpy as np
import onnx
import pytest

import cortex
from cortex.commands.decompose import decompose_model
from cortex.dag import build_dag
from cortex.runtime.policy import POLICIES
from cortex.runtime.trace import process_maxrss_mb, trace_schema, validate_trace
from ir.errors import CortexError
from ir.fs import write_bytes_atomically
from passes.partition import PartitionIntoCUs
from runtime_cases import build, every_cu_in_order, random_model, two_output_model
from testdata import run_onnxruntime, sample_model
from wasm_cases import compile_pipeline


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)}


# Both models are built with x marked repeating, so that balanced has cache hits to show: a
# dag.json that marks nothing caches nothing.
@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    return build(two_output_model(), tmp_path_factory.mktemp("two_outputs"), cache_inputs=("x",))


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    return build(random_model(), tmp_path_factory.mktemp("noisy"), fallback="onnxruntime", cache_inputs=("x",))


@pytest.mark.parametrize("name", ["cnn", "transformer_block", "mlp"])
def test_strict_is_bitwise_the_runtime_before_policies(name, tmp_path):
    case = sample_model(name)
    dag_path = compile_pipeline(case.path, tmp_path, input_shapes=case.input_shapes, dims=case.dims,
                                min_cu_size=64, max_cu_depth=3)
    before = every_cu_in_order(dag_path, case.inputs)
    model = cortex.load(dag_path, policy="strict")
    for _ in range(2):     # strict never caches: the second run runs every CU again
        got = model.run(case.inputs)
        assert got.keys() == before.keys()
        for key in before:
            np.testing.assert_array_equal(got[key], before[key])
        assert model.last_trace["activated_cus"] == model.dag["order"] and model.last_trace["skipped_cus"] == []
    # balanced's first run runs the same CUs on the same inputs: the same bits.
    balanced = cortex.load(dag_path).run(case.inputs)
    for key in before:
        np.testing.assert_array_equal(balanced[key], before[key])


def upstream_cus(dag: dict, outputs: list[str]) -> set[str]:
    """The CUs producing `outputs` and their ancestors in dag.json's edges."""
    graph = nx.DiGraph((e["from"], e["to"]) for e in dag["edges"])
    graph.add_nodes_from(cu["id"] for cu in dag["cus"])
    producers = {dag["tensors"][name]["producer"] for name in outputs}
    return producers | set().union(*(nx.ancestors(graph, p) for p in producers))


def test_requested_outputs_run_only_the_cus_upstream_of_them(two_outputs):
    model = cortex.load(two_outputs)
    dag = model.dag
    only_y2 = next(cu["id"] for cu in dag["cus"] if cu["outputs"] == ["y2"])   # MatMul(t, w3)
    got = model.run(feeds(), outputs=["y1"])
    assert list(got) == ["y1"]
    np.testing.assert_allclose(got["y1"], run_onnxruntime(model.path.parent / "two_outputs.onnx", feeds())["y1"],
                               rtol=1e-5, atol=1e-6)
    trace = model.last_trace
    upstream = upstream_cus(dag, ["y1"])
    assert only_y2 not in upstream
    assert trace["activated_cus"] == [cu for cu in dag["order"] if cu in upstream]
    assert trace["skipped_cus"] == [{"cu": only_y2, "reason": "not needed"}]
    assert trace["requested_outputs"] == ["y1"]
    validate_trace(trace)


def test_strict_runs_every_cu_but_returns_only_the_requested_outputs(two_outputs):
    model = cortex.load(two_outputs, policy="strict")
    got = model.run(feeds(), outputs=["y1"])
    assert list(got) == ["y1"]
    assert model.last_trace["activated_cus"] == model.dag["order"] and model.last_trace["skipped_cus"] == []
    np.testing.assert_array_equal(got["y1"], every_cu_in_order(two_outputs, feeds())["y1"])


def test_a_per_call_policy_overrides_the_models(two_outputs):
    model = cortex.load(two_outputs)                    # balanced
    model.run(feeds())
    model.run(feeds(), policy="strict")                 # no cache lookups: every CU runs again
    assert model.last_trace["policy"] == "strict" and model.last_trace["activated_cus"] == model.dag["order"]
    model.run(feeds())
    assert model.last_trace["policy"] == "balanced" and model.last_trace["activated_cus"] == []


def test_an_unknown_output_name_is_one_clear_error(two_outputs):
    model = cortex.load(two_outputs)
    with pytest.raises(CortexError, match=r"^unknown output 'z': the model's outputs are 'y1', 'y2'$"):
        model.run(feeds(), outputs=["y1", "z"])
    with pytest.raises(CortexError, match="no outputs requested"):
        model.run(feeds(), outputs=[])
    with pytest.raises(CortexError, match="unknown policy 'fast'"):
        model.run(feeds(), policy="fast")


def test_build_dag_records_the_source_model_relative_to_dag_json(two_outputs):
    dag = json.loads(two_outputs.read_text())
    source = dag["source_model"]
    assert source["path"] == "two_outputs.onnx"
    assert source["sha256"] == dag["model"]["sha256"]


def test_offline_runs_the_source_model_on_onnxruntime_without_the_artifacts(two_outputs, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(two_outputs.parent, folder)
    shutil.rmtree(folder / "wasm-bin")                 # offline is the fallback when CUs cannot load
    model = cortex.load(folder / "dag.json", policy="offline")
    got = model.run(feeds())
    want = run_onnxruntime(folder / "two_outputs.onnx", feeds(), optimize=True)
    for name in ("y1", "y2"):
        np.testing.assert_array_equal(got[name], want[name])
    trace = model.last_trace
    assert trace["policy"] == "offline" and trace["activated_cus"] == [] and trace["cus"] == []
    assert trace["offline"]["model"] == "two_outputs.onnx" and trace["offline"]["runtime"] == "onnxruntime"
    assert trace["sandbox_stats"]["wasm_executions"] == 0
    assert trace["sandbox_stats"]["peak_memory_basis"] == "process maxrss"
    validate_trace(trace)
    assert list(model.run(feeds(), outputs=["y2"])) == ["y2"]


def test_offline_refuses_a_changed_or_missing_source_model_in_one_line(two_outputs, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(two_outputs.parent, folder)
    source = folder / "two_outputs.onnx"
    changed = onnx.load(source)
    changed.graph.initializer[0].raw_data = bytes(len(changed.graph.initializer[0].raw_data))
    onnx.save(changed, source)
    model = cortex.load(folder / "dag.json")            # balanced: the CUs do not need it
    np.testing.assert_array_equal(model.run(feeds())["y1"], every_cu_in_order(two_outputs, feeds())["y1"])
    with pytest.raises(CortexError, match=r"two_outputs\.onnx: the source model changed since build-dag") as info:
        model.run(feeds(), policy="offline")
    assert "\n" not in str(info.value)
    source.unlink()
    with pytest.raises(CortexError, match=r"two_outputs\.onnx: the source model dag\.json records is missing"):
        cortex.load(folder / "dag.json", policy="offline")


def test_a_source_model_path_must_be_relative(two_outputs, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(two_outputs.parent, folder)
    dag = json.loads((folder / "dag.json").read_text())
    dag["source_model"]["path"] = str(folder / "two_outputs.onnx")
    (folder / "dag.json").write_text(json.dumps(dag))
    with pytest.raises(CortexError, match="source_model path .* is not relative to the folder of dag.json"):
        cortex.load(folder / "dag.json", policy="offline")


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_trace_follows_its_schema_under_every_policy(policy, noisy):
    model = cortex.load(noisy, policy=policy)
    validate_trace(model.last_trace)                    # before any run, too
    for _ in range(2):
        model.run(feeds())
        trace = model.last_trace
        validate_trace(trace)
        assert trace["policy"] == policy
        assert json.loads(json.dumps(trace)) == trace   # plain JSON
    if policy == "offline":
        return
    dag = model.dag
    random_cu = next(cu["id"] for cu in dag["cus"] if cu.get("random"))
    # The random CU is the fallback CU (onnxruntime): it runs every time and is reported as such.
    assert random_cu in trace["activated_cus"]
    assert trace["fell_back_cus"] == [{"cu": random_cu, "reason": "fallback runtime"}]
    ran = {entry["cu"]: entry["device"] for entry in trace["cus"]}
    assert trace["sandbox_stats"]["wasm_executions"] == sum(1 for d in ran.values() if d == "wasm")
    assert trace["sandbox_stats"]["peak_memory_mb"] > 0
    assert [e["name"] for e in trace["traceEvents"]] == trace["activated_cus"]
    assert trace["total_seconds"] == sum(entry["seconds"] for entry in trace["cus"])


def test_the_trace_read_later_describes_the_request_it_follows(two_outputs):
    model = cortex.load(two_outputs, policy="strict")
    model.run(feeds(), outputs=["y1"])
    model.run(feeds())
    peak = model.last_trace["sandbox_stats"]["process_maxrss_mb"]
    grown = np.ones(64 << 17)                # 64 MB more after the request, before its trace is read
    trace = model.last_trace
    assert trace["requested_outputs"] == [spec["name"] for spec in model.dag["outputs"]]
    assert trace["sandbox_stats"]["process_maxrss_mb"] == peak
    assert model.last_trace is trace         # assembled once
    assert grown.sum() > 0


def test_process_maxrss_is_the_processes_own_peak():
    grown = np.ones(64 << 17)
    grown[::512] = 2.0                       # touched: resident
    status = {line.split(":")[0]: line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")}
    assert abs(process_maxrss_mb() - int(status["VmHWM"]) / 1024) < 2.0


def test_without_the_source_model_build_dag_records_none_and_offline_says_so(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(two_output_model(), path)
    decompose_model(path, tmp_path / "cus", PartitionIntoCUs(min_cu_size=0, max_cu_depth=1))
    path.unlink()                                       # moved away after decompose
    dag = build_dag(tmp_path / "cus", tmp_path / "dag.json")
    assert "source_model" not in dag
    write_bytes_atomically(tmp_path / "dag.json", json.dumps(dag).encode())
    with pytest.raises(CortexError, match=r"dag\.json: records no source model, so the offline policy cannot run"):
        cortex.load(tmp_path / "dag.json", device="onnxruntime", policy="offline")


def test_offline_refuses_a_dag_built_with_frozen_inputs(two_outputs, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(two_outputs.parent, folder)
    dag = json.loads((folder / "dag.json").read_text())
    dag["options"]["frozen_inputs"] = [{"name": "mask", "dtype": "bool", "shape": [4], "sha256": "0" * 64}]
    (folder / "dag.json").write_text(json.dumps(dag))
    with pytest.raises(CortexError, match="built with --freeze-input mask"):
        cortex.load(folder / "dag.json", policy="offline")


def test_the_trace_schema_is_valid_and_rejects_what_the_contract_rules_out(two_outputs):
    jsonschema.Draft202012Validator.check_schema(trace_schema())
    model = cortex.load(two_outputs)
    model.run(feeds(), outputs=["y1"])
    for damage in (lambda t: t["skipped_cus"][0].update(reason="bored"),
                   lambda t: t["sandbox_stats"].pop("wasm_executions"),
                   lambda t: t.update(activated_cus=["not-a-cu"])):
        trace = json.loads(json.dumps(model.last_trace))
        damage(trace)
        with pytest.raises(jsonschema.ValidationError):
            validate_trace(trace)
