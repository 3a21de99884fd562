"""One bundle for every engine: `--features "simd,relaxed-simd;simd"` builds each CU as a relaxed
SIMD module (the primary, which Python's wasmtime runs) and a plain SIMD alternate, byte for byte
the module a `--features simd` build makes. Node 20 without --experimental-wasm-relaxed-simd runs
the alternates, with the bits of Python's wasmtime run of the plain build and onnxruntime's values
within tolerance; with the flag it runs the primaries; the trace says which features ran. A default
build and its bundle run in Node without the flag; a bad --features list is one line (exit 2);
cortex bundle copies the alternates and refuses a tampered one, as the runtime does."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import assert_one_line_error, run_cli
from js_cases import JS_DIR, NODE, REPO_ROOT, write_requests
from onnx import TensorProto, helper, numpy_helper
from testdata import run_onnxruntime

import cortex
from cortex.dag import read_dag
from cortex.runtime.trace import validate_trace
from ir.errors import CortexError

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

CHECK = JS_DIR / "testing" / "engine_features_check.mjs"
RELAXED_FLAG = "--experimental-wasm-relaxed-simd"
BOTH = "simd,relaxed-simd;simd"
NODE_TIMEOUT_S = 120
BUILD_FLAGS = ("--wasm-opt-level", "3", "--min-cu-size", "16")


def engines_model(rng) -> onnx.ModelProto:
    """Conv + Relu + MaxPool, a 1x1 Conv, then Gemm + Softmax: kernels whose relaxed SIMD build
    fuses multiply-adds, in two CUs."""
    w1 = rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2
    b1 = rng.standard_normal(16).astype(np.float32) * 0.1
    w2 = rng.standard_normal((32, 16, 1, 1)).astype(np.float32) * 0.2
    wg = rng.standard_normal((32 * 8 * 8, 10)).astype(np.float32) * 0.05
    bg = rng.standard_normal(10).astype(np.float32) * 0.1
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2"], ["c2"]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Flatten", ["r2"], ["f"]),
             helper.make_node("Gemm", ["f", "wg", "bg"], ["g"]),
             helper.make_node("Softmax", ["g"], ["y"], axis=1)]
    weights = [numpy_helper.from_array(a, n) for n, a in (("w1", w1), ("b1", b1), ("w2", w2), ("wg", wg), ("bg", bg))]
    graph = helper.make_graph(nodes, "engines", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict, dict]:
    """The model's path, its feeds and onnxruntime's outputs."""
    path = tmp_path_factory.mktemp("js-engines") / "model.onnx"
    model = engines_model(np.random.default_rng(3))
    onnx.save(model, path)
    feeds = {"x": np.random.default_rng(5).standard_normal((1, 8, 16, 16)).astype(np.float32)}
    return path, feeds, run_onnxruntime(model, feeds)


@pytest.fixture(scope="module")
def builds(model):
    """--wasm-features text -> the build's dag.json, each built once."""
    path, _, _ = model
    made: dict[str, Path] = {}

    def build(features: str | None, *flags: str) -> Path:
        key = json.dumps([features, flags])
        if key not in made:
            out = path.parent / f"build-{len(made)}"
            chosen = ("--wasm-features", features) if features is not None else ()
            code, _, err = run_cli(["build", path, "--output", out, *chosen, *BUILD_FLAGS, *flags, "--no-cache"])
            assert code == 0, err
            made[key] = out / "dag.json"
        return made[key]
    return build


def run_node(tmp_path: Path, dag: Path, feeds: dict, relaxed_flag: bool) -> dict:
    """The check script's report ({"trace", "error"}); the outputs under tmp_path/out."""
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    (inputs,) = [r["inputs"] for r in write_requests(tmp_path, [{"inputs": feeds, "outputs": {}}])]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"dag": str(dag), "folder": str(tmp_path), "inputs": inputs, "out": str(out)}))
    done = subprocess.run([NODE, *([RELAXED_FLAG] if relaxed_flag else []), str(CHECK), str(job)],
                          capture_output=True, text=True, timeout=NODE_TIMEOUT_S, cwd=REPO_ROOT, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["trace"] is not None:
        validate_trace(report["trace"])
    return report


def node_outputs(tmp_path: Path, like: dict) -> dict[str, np.ndarray]:
    return {name: np.fromfile(tmp_path / "out" / f"{name}.bin", dtype=want.dtype).reshape(want.shape)
            for name, want in like.items()}


def wasmtime_outputs(dag: Path, feeds: dict) -> dict[str, np.ndarray]:
    loaded = cortex.load(dag, threads=1, policy="strict")
    try:
        return {name: np.array(y) for name, y in loaded.run(feeds).items()}
    finally:
        loaded.close()


def node_has_relaxed_simd_without_a_flag() -> bool:
    script = "console.log(WebAssembly.validate(new Uint8Array(%s)))" % json.dumps(
        [0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 123, 3, 2, 1, 0, 10, 43, 1, 41, 0, 253, 12,
         *[0] * 16, 253, 12, *[0] * 16, 253, 128, 2, 11])
    return subprocess.run([NODE, "-e", script], capture_output=True, text=True, check=True).stdout.strip() == "true"


needs_node_without_relaxed = pytest.mark.skipif(
    NODE is not None and node_has_relaxed_simd_without_a_flag(), reason="this Node runs relaxed SIMD without a flag")


def test_each_cu_records_a_plain_simd_alternate_that_is_the_plain_builds_module(builds):
    both, plain = read_dag(builds(BOTH)), read_dag(builds("simd"))
    for cu, plain_cu in zip(both["cus"], plain["cus"], strict=True):
        record = cu["artifacts"]["wasm"]
        assert record["options"]["features"] == ["relaxed-simd", "simd"]
        (alternate,) = record["alternates"]
        assert alternate["features"] == ["simd"] and alternate["path"].endswith(f"{cu['id']}.simd.wasm")
        assert alternate["sha256"] == plain_cu["artifacts"]["wasm"]["sha256"], "not the plain build's module"
        assert alternate["sha256"] != record["sha256"]
        assert "memory" not in alternate, "the same memory plan as the primary's is not repeated"
        assert plain_cu["artifacts"]["wasm"]["memory"] == record["memory"]


@needs_node_without_relaxed
def test_node_without_the_flag_runs_the_plain_simd_alternates(tmp_path, model, builds):
    _, feeds, reference = model
    report = run_node(tmp_path, builds(BOTH), feeds, relaxed_flag=False)
    assert report["error"] is None, report["error"]
    trace = report["trace"]
    assert trace["wasm_features"] == ["simd"]
    assert [cu["wasm_features"] for cu in trace["cus"]] == [["simd"]] * len(trace["cus"]) and trace["cus"]
    got = node_outputs(tmp_path, reference)
    expected = wasmtime_outputs(builds("simd"), feeds)
    for name, want in reference.items():
        np.testing.assert_array_equal(got[name], expected[name], err_msg="not the plain SIMD build's bits")
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-6)


def test_node_with_the_flag_runs_the_relaxed_primaries(tmp_path, model, builds):
    _, feeds, reference = model
    report = run_node(tmp_path, builds(BOTH), feeds, relaxed_flag=True)
    assert report["error"] is None, report["error"]
    assert report["trace"]["wasm_features"] == ["relaxed-simd,simd"]
    assert {tuple(cu["wasm_features"]) for cu in report["trace"]["cus"]} == {("relaxed-simd", "simd")}
    got = node_outputs(tmp_path, reference)
    for name, want in reference.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-6)


@needs_node_without_relaxed
def test_a_relaxed_build_without_alternates_is_refused_in_one_line_without_the_flag(tmp_path, model, builds):
    _, feeds, _ = model
    report = run_node(tmp_path, builds("simd,relaxed-simd"), feeds, relaxed_flag=False)
    message = report["error"]
    assert message is not None and "\n" not in message
    assert "the modules use WebAssembly relaxed-simd, which this engine lacks" in message, message


def test_a_default_build_and_its_bundle_run_in_node_without_the_flag(tmp_path, model, builds):
    _, feeds, reference = model
    dag = builds(None)
    assert {f for cu in read_dag(dag)["cus"] for f in cu["artifacts"]["wasm"]["options"]["features"]} == {"simd"}
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert code == 0, err
    report = run_node(tmp_path, site / "dag.json", feeds, relaxed_flag=False)
    assert report["error"] is None, report["error"]
    assert report["trace"]["wasm_features"] == ["simd"]
    got = node_outputs(tmp_path, reference)
    for name, want in reference.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-6)


@needs_node_without_relaxed
def test_the_bundle_carries_the_alternates_and_runs_them_without_the_flag(tmp_path, model, builds):
    _, feeds, reference = model
    dag = builds(BOTH)
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert code == 0, err
    for cu in read_dag(site / "dag.json")["cus"]:
        for module in [cu["artifacts"]["wasm"], *cu["artifacts"]["wasm"]["alternates"]]:
            assert (site / module["path"]).read_bytes() == (dag.parent / module["path"]).read_bytes()
    report = run_node(tmp_path, site / "dag.json", feeds, relaxed_flag=False)
    assert report["error"] is None and report["trace"]["wasm_features"] == ["simd"], report
    got = node_outputs(tmp_path, reference)
    for name, want in reference.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-6)


def _copy_of_build(dag: Path, into: Path) -> Path:
    shutil.copytree(dag.parent, into)
    return into / "dag.json"


def test_bundle_refuses_a_tampered_alternate_and_leaves_output_as_it_was(tmp_path, builds):
    dag = _copy_of_build(builds(BOTH), tmp_path / "model")
    alternate = dag.parent / read_dag(dag)["cus"][-1]["artifacts"]["wasm"]["alternates"][0]["path"]
    alternate.write_bytes(alternate.read_bytes() + b"\0")
    site = tmp_path / "site"
    site.mkdir()
    (site / "keep.txt").write_text("before")
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert_one_line_error(code, err, alternate.name, "sha256 differs")
    assert [p.name for p in site.iterdir()] == ["keep.txt"]


@needs_node_without_relaxed
def test_the_runtime_refuses_a_tampered_alternate_it_would_run(tmp_path, model, builds):
    _, feeds, _ = model
    dag = _copy_of_build(builds(BOTH), tmp_path / "model")
    alternate = dag.parent / read_dag(dag)["cus"][0]["artifacts"]["wasm"]["alternates"][0]["path"]
    alternate.write_bytes(alternate.read_bytes() + b"\0")
    message = run_node(tmp_path, dag, feeds, relaxed_flag=False)["error"]
    assert message is not None and "\n" not in message
    assert alternate.name in message and "stale or tampered" in message, message


@pytest.mark.parametrize("features, fragment", [
    ("simd,relaxed-simd;;simd", "empty feature set"),
    ("simd;simd", "names the set simd twice"),
    ("simd;relaxed-simd", "relaxed-simd needs simd"),
    ("simd;fast", "unknown --features fast"),
    ("simd,threads;simd", "every set must have threads"),
])
def test_a_bad_features_list_is_one_line(tmp_path, features, fragment):
    code, _, err = run_cli(["compile-wasm", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "out",
                            "--features", features])
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "out").exists()


def test_build_names_its_own_flag_in_a_bad_features_list(tmp_path, model):
    path, _, _ = model
    code, _, err = run_cli(["build", path, "--output", tmp_path / "out", "--wasm-features", "simd;simd"])
    assert_one_line_error(code, err, "--wasm-features", "twice")


def test_memory_shared_refuses_alternates_in_one_line(tmp_path):
    code, _, err = run_cli(["compile-wasm", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "out",
                            "--features", BOTH, "--memory", "shared"])
    assert_one_line_error(code, err, "--memory shared", "per-cu")


def test_variants_get_alternates_too(builds):
    dag = read_dag(builds(BOTH, "--wasm-variants", "fp16,int8"))
    variants = [v["artifacts"]["wasm"] for cu in dag["cus"] for v in cu.get("variants", {}).values()]
    assert variants
    for record in variants:
        (alternate,) = record["alternates"]
        assert alternate["features"] == ["simd"] and alternate["sha256"] != record["sha256"]


def test_the_compile_cache_tells_alternate_sets_apart(tmp_path, model):
    path, _, _ = model
    cache = tmp_path / "cache"

    def compiled(features: str, out: str) -> int:
        code, out_text, err = run_cli(["build", path, "--output", tmp_path / out, "--wasm-features", features,
                                       *BUILD_FLAGS, "--cache-dir", cache, "--json"])
        assert code == 0, err
        return json.loads(out_text)["compiled_cus"]

    assert compiled("simd,relaxed-simd", "a") > 0
    assert compiled(BOTH, "b") > 0, "a build with alternates came from the cache of one without"
    assert compiled(BOTH, "c") == 0


def _dag_with_alternate(builds, tmp_path: Path, **changes) -> Path:
    dag = _copy_of_build(builds(BOTH), tmp_path / "model")
    document = json.loads(dag.read_text())
    document["cus"][0]["artifacts"]["wasm"]["alternates"][0].update(changes)
    dag.write_text(json.dumps(document))
    return dag


@pytest.mark.parametrize("changes, fragment", [
    ({"path": "../elsewhere.wasm"}, "leaves the folder"),
    ({"features": ["relaxed-simd", "simd"]}, "already recorded"),
])
def test_dag_checks_hold_alternates_to_the_primarys_rules(tmp_path, builds, changes, fragment):
    dag = _dag_with_alternate(builds, tmp_path, **changes)
    with pytest.raises(CortexError, match=fragment):
        read_dag(dag)
