"""The JavaScript runtime on `--wasm-features threads` builds (js/src/kernel_threads.js), under Node
(js/testing/kernel_threads_check.mjs): a split CU gives the bits of Python's wasmtime run of the same
build on 1 and 2 threads (worker_threads workers on its shared memory), within onnxruntime's
tolerance; a build without the feature runs as before; a worker that traps mid-kernel fails the
request in one line naming the CU and the thread, and the session goes on, after `release()` too;
where shared memory is missing (a page that is not crossOriginIsolated) or the thread may not block
(a page's main thread, for threads > 1), creating the session fails in one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli
from js_cases import JS_DIR, NODE, REPO_ROOT, write_requests
from test_kernel_threads import BUILD_FLAGS, CASES
from testdata import run_onnxruntime

import cortex
from cortex.runtime.trace import validate_trace

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

THREADS = "simd,relaxed-simd,threads"
PLAIN = "simd,relaxed-simd"
CHECK = JS_DIR / "testing" / "kernel_threads_check.mjs"
NODE_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """name, features -> (dag.json, feeds), each built once for the module's tests."""
    folder = tmp_path_factory.mktemp("js-threads")
    made: dict[tuple[str, str], tuple[Path, dict]] = {}

    def build(name: str, features: str) -> tuple[Path, dict]:
        if (name, features) not in made:
            model_path = folder / f"{name}.onnx"
            model = CASES[name](np.random.default_rng(7))
            onnx.save(model, model_path)
            out = folder / f"{name}-{features.replace(',', '-')}"
            code, _, err = run_cli(["build", model_path, "--output", out, "--wasm-features", features,
                                    *BUILD_FLAGS.get(name, ())])
            assert code == 0, err
            rng = np.random.default_rng(11)
            feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
                     for i in model.graph.input}
            made[name, features] = out / "dag.json", feeds
        return made[name, features]
    return build


def wasmtime_outputs(dag: Path, feeds: dict) -> dict[str, np.ndarray]:
    model = cortex.load(dag, threads=1, policy="strict")
    try:
        return {name: np.array(y) for name, y in model.run(feeds).items()}
    finally:
        model.close()


def run_node(tmp_path: Path, dag: Path, feeds: dict, threads: list[int], **flags) -> dict:
    """The check script's report, its outputs under tmp_path/out."""
    (tmp_path / "out").mkdir()
    (inputs,) = [r["inputs"] for r in write_requests(tmp_path, [{"inputs": feeds, "outputs": {}}])]
    job = {"dag": str(dag), "folder": str(tmp_path), "inputs": inputs, "out": str(tmp_path / "out"),
           "threads": threads, **flags}
    (tmp_path / "job.json").write_text(json.dumps(job))
    done = subprocess.run([NODE, "--experimental-wasm-relaxed-simd", str(CHECK), str(tmp_path / "job.json")],
                          capture_output=True, text=True, timeout=NODE_TIMEOUT_S, cwd=REPO_ROOT, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def node_output(tmp_path: Path, label: str, name: str, like: np.ndarray) -> np.ndarray:
    return np.fromfile(tmp_path / "out" / f"{label}-{name}.bin", dtype=like.dtype).reshape(like.shape)


@pytest.mark.parametrize("name", ["matmul-rows", "attention-batches", "conv-channels"])
def test_a_threads_build_gives_wasmtimes_bits_on_1_and_2_threads(tmp_path, builds, name):
    dag, feeds = builds(name, THREADS)
    expected = wasmtime_outputs(dag, feeds)
    report = run_node(tmp_path, dag, feeds, [1, 2])
    assert report["create_errors"] == {}
    (reference,) = run_onnxruntime(onnx.load(dag.parent.parent / f"{name}.onnx"), feeds).values()
    for threads in (1, 2):
        trace = report["runs"][str(threads)]["trace"]
        validate_trace(trace)
        assert trace["threads"]["kernel_threads"] == threads and trace["threads"]["split_cus"], trace["threads"]
        for output, want in expected.items():
            got = node_output(tmp_path, f"t{threads}", output, want)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} on {threads} threads")
            np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())


def test_a_build_without_the_feature_runs_as_before(tmp_path, builds):
    dag, feeds = builds("matmul-rows", PLAIN)
    expected = wasmtime_outputs(dag, feeds)
    report = run_node(tmp_path, dag, feeds, [2])
    assert report["runs"]["2"]["trace"]["threads"]["split_cus"] == []
    for output, want in expected.items():
        np.testing.assert_array_equal(node_output(tmp_path, "t2", output, want), want)


def test_a_worker_trapping_mid_kernel_fails_the_request_in_one_line_and_the_session_goes_on(tmp_path, builds):
    dag, feeds = builds("matmul-rows", THREADS)
    expected = wasmtime_outputs(dag, feeds)
    report = run_node(tmp_path, dag, feeds, [2], fault=True, release=True)
    run = report["runs"]["2"]
    message = run["fault_error"]
    assert message is not None, f"no worker took the faulty part in {run['fault_attempts']} requests"
    cu_id = run["trace"]["threads"]["split_cus"][0]
    assert "\n" not in message and message.startswith(f"{cu_id} (") and "kernel thread 1 trapped" in message, message
    for label in ("t2-fault", "t2-release"):       # a fresh memory and workers; then workers started again
        for output, want in expected.items():
            np.testing.assert_array_equal(node_output(tmp_path, label, output, want), want, err_msg=label)


def test_without_shared_memory_or_a_thread_that_may_block_create_fails_in_one_line(tmp_path, builds):
    dag, feeds = builds("matmul-rows", THREADS)
    cu_id = cortex.load(dag).dag["cus"][0]["id"]
    for folder in ("isolation", "main"):
        (tmp_path / folder).mkdir()
    report = run_node(tmp_path / "isolation", dag, feeds, [1], not_isolated=True)
    message = report["create_errors"]["1"]
    assert "\n" not in message and f"{cu_id} was built with --wasm-features threads" in message \
        and "crossOriginIsolated" in message and "rebuild without the threads feature" in message, message
    report = run_node(tmp_path / "main", dag, feeds, [1, 2], main_thread=True)
    message = report["create_errors"]["2"]
    assert "\n" not in message and "threads 2" in message and "in a Worker" in message, message
    assert "1" in report["runs"], "one thread never waits: it runs on a page's main thread"
    expected = wasmtime_outputs(dag, feeds)
    for output, want in expected.items():
        np.testing.assert_array_equal(node_output(tmp_path / "main", "t1", output, want), want)


def test_the_bundle_ships_the_worker_script(tmp_path, builds):
    dag, _ = builds("matmul-rows", THREADS)
    code, _, err = run_cli(["bundle", dag, "--output", tmp_path / "site"])
    assert code == 0, err
    runtime = tmp_path / "site" / "cortex-runtime"
    assert (runtime / "kernel_worker.js").read_bytes() == (JS_DIR / "src" / "kernel_worker.js").read_bytes()
    assert "kernel_worker.js" in (runtime / "kernel_threads.js").read_text()
