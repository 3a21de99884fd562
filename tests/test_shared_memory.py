"""compile-wasm --memory shared: every CU's module imports one model memory, and a tensor crossing a
CU border is read in place from its producer's slot. Built both ways, the same models give
identical outputs, equal to onnxruntime's; the trace counts 0 bytes copied between CUs under
shared and more under per-cu; activation, requested outputs, the result cache, external weights
and threads keep their meaning; a trap rebuilds the whole memory; bad combinations are one line."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import wasmtime
from cli_helpers import assert_one_line_error, run_cli
from onnx import TensorProto, helper, numpy_helper
from runtime_cases import two_output_model
from test_conditional_cus import if_model
from test_fallback_cus import mixed_model
from testdata import run_onnxruntime

import cortex
from backends.registry import target
from backends.wasm.options import WasmOptions
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from cortex.runtime.trace import validate_trace
from ir.errors import CortexError
from ir.fs import sha256_bytes, write_bytes_atomically
from passes.partition import PartitionIntoCUs

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
RTOL, ATOL = 1e-4, 1e-5
POISON = 1003.0       # x[0, 0] that turns the hostile module below hostile


def densenet_like() -> onnx.ModelProto:
    """A dense block in small: each Conv reads the Concat of everything before it, so tensors cross
    several CU borders and one feeds several consumers, then a pooled classifier."""
    rng = np.random.default_rng(3)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / 4).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], name="stem"),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0")]
    inits, channels, features = [w("w0", 8, 3, 3, 3)], 8, "r0"
    for i in range(1, 4):
        nodes += [helper.make_node("Conv", [features, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"),
                  helper.make_node("Concat", [features, f"r{i}"], [f"cat{i}"], axis=1, name=f"concat{i}")]
        inits.append(w(f"w{i}", 4, channels, 3, 3))
        channels, features = channels + 4, f"cat{i}"
    nodes += [helper.make_node("GlobalAveragePool", [features], ["pooled"], name="pool"),
              helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "fc", "bias"], ["y"], name="fc")]
    inits += [w("fc", channels, 10), w("bias", 10)]
    graph = helper.make_graph(nodes, "densenet_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


MODELS = {"cnn": lambda: onnx.load(SAMPLES / "cnn.onnx"), "branching": two_output_model,
          "densenet_like": densenet_like, "if": lambda: if_model("computed")}
# The models whose cache tests need hits are built with their input marked repeating: a dag.json
# that marks nothing caches nothing.
CACHE_INPUTS = {"densenet_like": ("x",), "if": ("x",)}


def feeds_for(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def build(model: onnx.ModelProto, out: Path, fallback: str | None = None, cache_inputs: tuple[str, ...] = (),
          **options) -> Path:
    """decompose (one op per CU where fusion allows; `cache_inputs` marked repeating) -> build-dag
    -> compile-wasm with `options`."""
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out / "m.onnx")
    decompose_model(out / "m.onnx", out / "cus", PartitionIntoCUs(min_cu_size=0, max_cu_depth=1, fallback=fallback,
                                                                  cache_inputs=cache_inputs))
    dag_path = out / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out / "cus", dag_path), indent=2).encode())
    compile_cu_dir(target("wasm"), out / "cus", out / "wasm-bin", WasmOptions(**options), dag_path, jobs=1)
    return dag_path


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("shared")
    return {(name, memory): build(make(), root / name / memory, cache_inputs=CACHE_INPUTS.get(name, ()), memory=memory)
            for name, make in MODELS.items() for memory in ("per-cu", "shared")}


def copied(model) -> int:
    validate_trace(model.last_trace)
    return model.last_trace["sandbox_stats"]["bytes_copied_between_cus"]


@pytest.mark.parametrize("name", MODELS)
def test_both_memories_give_identical_outputs_equal_to_onnxruntime(builds, name):
    model = MODELS[name]()
    feeds = feeds_for(model)
    expected = run_onnxruntime(model, feeds)
    results, copies = {}, {}
    for memory in ("per-cu", "shared"):
        loaded = cortex.load(builds[name, memory], threads=1)
        results[memory] = loaded.run(feeds)
        copies[memory] = copied(loaded)
    for out, want in expected.items():
        np.testing.assert_array_equal(results["shared"][out], results["per-cu"][out])
        np.testing.assert_allclose(results["shared"][out], want, rtol=RTOL, atol=ATOL)
    # An If's output is whichever case ran: no single slot holds it (strict runs both), so it is copied.
    assert copies["shared"] == select_bytes_read(builds[name, "shared"]) < copies["per-cu"]


def select_bytes_read(dag_path: Path) -> int:
    dag = json.loads(dag_path.read_text())
    selected = {s["tensor"] for s in dag.get("selects", [])}
    return sum(dag["tensors"][name]["bytes"] for cu in dag["cus"] for name in cu["inputs"] if name in selected)


def test_the_plan_gives_each_cu_its_own_region_and_reads_borders_in_place(builds):
    dag = json.loads(builds["densenet_like", "shared"].read_text())
    records = {cu["id"]: cu["artifacts"]["wasm"]["memory"] for cu in dag["cus"]}
    shared = [r["shared"] for r in records.values()]
    assert len({s["memory_bytes"] for s in shared}) == 1
    spans = sorted((s["base"], s["base"] + s["region_bytes"]) for s in shared)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))     # no two regions overlap
    slots = {e["name"]: e["offset"] for r in records.values() for e in r["outputs"]}
    borders = [(e["name"], e["offset"]) for r in records.values() for e in r["inputs"] if e["name"] in slots]
    assert borders and all(slots[name] == offset for name, offset in borders)


def test_activation_requested_outputs_and_the_cache_keep_their_meaning(builds):
    model = MODELS["if"]()
    shared = cortex.load(builds["if", "shared"], threads=1, cache_bytes=1 << 20)
    positive = {"x": np.abs(feeds_for(model)["x"])}
    negative = {"x": -positive["x"]}
    for feeds in (positive, negative, positive, negative):     # each branch in turn, then from the cache
        np.testing.assert_allclose(shared.run(feeds)["y"], run_onnxruntime(model, feeds)["y"], rtol=RTOL, atol=ATOL)
    assert shared.last_trace["cache"]["hits"] > 0
    assert {s["reason"] for s in shared.last_trace["skipped_cus"]} >= {"inactive branch"}

    two = two_output_model()
    feeds = feeds_for(two)
    only = cortex.load(builds["branching", "shared"], threads=1).run(feeds, outputs=["y1"])
    assert list(only) == ["y1"]
    np.testing.assert_allclose(only["y1"], run_onnxruntime(two, feeds)["y1"], rtol=RTOL, atol=ATOL)


def test_cached_outputs_are_copies_not_views_of_the_shared_memory(builds):
    model = MODELS["densenet_like"]()
    loaded = cortex.load(builds["densenet_like", "shared"], threads=1, cache_bytes=1 << 22)
    first, second = feeds_for(model, 1), feeds_for(model, 2)
    loaded.run(first)
    loaded.run(second)                         # overwrites every slot the first request's outputs used
    again = loaded.run(first)                  # every CU a cache hit
    assert len(loaded.last_trace["skipped_cus"]) == len(loaded.dag["order"])
    np.testing.assert_allclose(again["y"], run_onnxruntime(model, first)["y"], rtol=RTOL, atol=ATOL)


def test_threads_run_a_shared_memory_on_the_calling_thread(builds):
    model = MODELS["branching"]()
    feeds = feeds_for(model)
    loaded = cortex.load(builds["branching", "shared"], threads=2)
    results = loaded.run(feeds)
    assert {entry["thread"] for entry in loaded.last_trace["cus"]} == {0}
    for out, want in run_onnxruntime(model, feeds).items():
        np.testing.assert_allclose(results[out], want, rtol=RTOL, atol=ATOL)


def test_external_weights_are_written_into_the_shared_memory(tmp_path):
    model = densenet_like()
    dag_path = build(model, tmp_path, memory="shared", external_weights=True)
    assert any("weights" in cu["artifacts"]["wasm"] for cu in json.loads(dag_path.read_text())["cus"])
    feeds = feeds_for(model)
    loaded = cortex.load(dag_path, threads=1)
    np.testing.assert_allclose(loaded.run(feeds)["y"], run_onnxruntime(model, feeds)["y"], rtol=RTOL, atol=ATOL)
    assert copied(loaded) == 0


def test_tensors_from_a_fallback_cu_are_written_in_and_read_in_place_after(tmp_path):
    model = mixed_model()       # MatMul, Relu -> TfIdfVectorizer on onnxruntime -> Tanh, Add
    feeds = feeds_for(model)
    expected = run_onnxruntime(model, feeds)
    results = {}
    for memory in ("per-cu", "shared"):
        loaded = cortex.load(build(model, tmp_path / memory, fallback="onnxruntime", memory=memory), threads=1)
        results[memory] = loaded.run(feeds)
        assert loaded.last_trace["cus_by_device"]["onnxruntime"] == 1
        if memory == "shared":
            assert copied(loaded) == 0
    for out, want in expected.items():
        np.testing.assert_array_equal(results["shared"][out], results["per-cu"][out])
        np.testing.assert_allclose(results["shared"][out], want, rtol=RTOL, atol=ATOL)


def _hostile_module(dag_path: Path, cu_id: str) -> None:
    """Replace the Relu CU of the branching model by a module that does its Relu, except that
    x[0, 0] == POISON first fills the whole shared memory (every CU's weights) with garbage and
    then traps: a memory that stayed in use would give every later request wrong outputs."""
    dag = json.loads(dag_path.read_text())
    record = next(cu for cu in dag["cus"] if cu["id"] == cu_id)["artifacts"]["wasm"]
    plan = record["memory"]
    x, h, size = plan["inputs"][0]["offset"], plan["outputs"][0]["offset"], plan["inputs"][0]["bytes"]
    total = plan["shared"]["memory_bytes"]
    pages = -(-total // 65536)
    wat = f'''(module
  (memory (export "memory") (import "env" "memory") {pages})
  (func (export "run") (local $i i32)
    (if (f32.eq (f32.load (i32.const {x})) (f32.const {POISON}))
      (then
        (loop $fill
          (i32.store (local.get $i) (i32.const 0x7f7f7f7f))
          (local.set $i (i32.add (local.get $i) (i32.const 4)))
          (br_if $fill (i32.lt_u (local.get $i) (i32.const {total // 4 * 4}))))
        (unreachable)))
    (loop $each
      (f32.store (i32.add (i32.const {h}) (local.get $i))
                 (f32.max (f32.load (i32.add (i32.const {x}) (local.get $i))) (f32.const 0)))
      (local.set $i (i32.add (local.get $i) (i32.const 4)))
      (br_if $each (i32.lt_u (local.get $i) (i32.const {size}))))))'''
    code = bytes(wasmtime.wat2wasm(wat))
    (dag_path.parent / record["path"]).write_bytes(code)
    record["sha256"], record["bytes"] = sha256_bytes(code), len(code)
    dag_path.write_text(json.dumps(dag, indent=2))


def test_a_trap_rebuilds_the_whole_shared_memory_with_its_weights(tmp_path):
    model = two_output_model()
    dag_path = build(model, tmp_path, memory="shared")
    relu = next(cu["id"] for cu in json.loads(dag_path.read_text())["cus"] if cu["op_types"] == ["Relu"])
    _hostile_module(dag_path, relu)
    loaded = cortex.load(dag_path, threads=1, cache_bytes=0)
    feeds = feeds_for(model)
    expected = run_onnxruntime(model, feeds)
    poisoned = {"x": feeds["x"].copy()}
    poisoned["x"][0, 0] = POISON
    for _ in range(2):
        with pytest.raises(CortexError, match=f"{relu} \\(Relu\\) trapped: .*shared memory was rebuilt"):
            loaded.run(poisoned)
        results = loaded.run(feeds)
        for out, want in expected.items():
            np.testing.assert_allclose(results[out], want, rtol=RTOL, atol=ATOL)
    assert loaded.sandbox_events() == {"traps": 2, "timeouts": 0, "memory_limit_hits": 0, "rebuilt": 2}


def test_cortex_build_and_run_through_the_cli(tmp_path):
    out = tmp_path / "mlp"
    code, _, err = run_cli(["build", SAMPLES / "mlp.onnx", "--output", out, "--dim", "batch=2",
                            "--wasm-memory", "shared", "--no-cache"])
    assert code == 0, err
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    code, _, err = run_cli(["run", out / "dag.json", "--input", tmp_path / "in.npz", "--output", tmp_path / "out.npz",
                            "--trace", tmp_path / "trace.json"])
    assert code == 0, err
    trace = json.loads((tmp_path / "trace.json").read_text())
    validate_trace(trace)
    assert trace["sandbox_stats"]["bytes_copied_between_cus"] == 0
    assert all(e["bytes_copied_between_cus"] == 0 for e in trace["cus"])
    model = onnx.load(SAMPLES / "mlp.onnx")
    want = run_onnxruntime(model, {"x": x})
    got = np.load(tmp_path / "out.npz")
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL)


def test_bad_combinations_are_one_line(builds, tmp_path):
    cus = builds["cnn", "per-cu"].parent / "cus"
    code, _, err = run_cli(["compile-wasm", "--cu-dir", cus, "--output", tmp_path / "w", "--memory", "shared",
                            "--variants", "fp16", "--no-cache"])
    assert_one_line_error(code, err, "--variants", "share one memory plan")
    assert not (tmp_path / "w").exists()
    code, _, err = run_cli(["run", builds["cnn", "shared"], "--example-inputs", "--memory-budget", "1"])
    assert_one_line_error(code, err, "--memory shared", "--memory per-cu")
    code, _, err = run_cli(["bundle", builds["cnn", "shared"], "--output", tmp_path / "site"])
    assert_one_line_error(code, err, "--memory shared", "JavaScript runtime")
    assert not (tmp_path / "site").exists()
