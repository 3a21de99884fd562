"""The JavaScript runtime's CU workers (js/src/cu_workers.js), under Node
(js/testing/cu_workers_check.mjs): a model of independent MatMul chains joined by a Sum runs with
`numThreads` 1, 2 and 3 with the same bits as one thread and within onnxruntime's tolerance, the
trace naming the mode, the walk and each CU's thread; a request whose policy looks CUs up in the
result cache walks sequentially (and says why) with the scheduler's skips; a worker that traps or
ends fails the request in one line naming the CU and the next request works, after `release()`
too; where SharedArrayBuffer is withheld (a page that is not crossOriginIsolated) none is made. In
headless Chromium a page that is not isolated runs numThreads 2 on a Web Worker with the same bits
and never constructs a SharedArrayBuffer, and an isolated page still runs a --wasm-features threads
build on kernel threads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli
from js_cases import JS_DIR, NODE, REPO_ROOT, write_requests
from onnx import TensorProto, helper, numpy_helper
from test_js_browser import CHROMIUM
from test_js_threads import THREADS, wasmtime_outputs
from test_js_threads import builds  # noqa: F401  (a fixture: pytest finds it by name)
from test_js_threads_browser import evaluate
from testdata import run_onnxruntime

from cortex.runtime.trace import validate_trace

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

CHECK = JS_DIR / "testing" / "cu_workers_check.mjs"
NODE_TIMEOUT_S = 120
BRANCHES, DEPTH, WIDTH, BATCH = 4, 3, 128, 64
# Each MatMul owns WIDTH * WIDTH parameters: at most two per CU, so the chains are CUs of their own.
SPLIT = ["--max-cu-size", str(2 * WIDTH * WIDTH + 1000)]


def branchy_model(rng: np.random.Generator) -> onnx.ModelProto:
    """BRANCHES chains of DEPTH MatMul + Relu on one input, summed."""
    nodes, weights, ends = [], [], []
    for b in range(BRANCHES):
        x = "x"
        for d in range(DEPTH):
            w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
            weights.append(numpy_helper.from_array(w, f"w{b}_{d}"))
            nodes += [helper.make_node("MatMul", [x, f"w{b}_{d}"], [f"m{b}_{d}"]),
                      helper.make_node("Relu", [f"m{b}_{d}"], [f"r{b}_{d}"])]
            x = f"r{b}_{d}"
        ends.append(x)
    nodes.append(helper.make_node("Sum", ends, ["y"]))
    graph = helper.make_graph(nodes, "branchy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, WIDTH])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def branchy(tmp_path_factory):
    """(model path, build folder -> dag.json, feeds), each build made once."""
    folder = tmp_path_factory.mktemp("js-cu-workers")
    model_path = folder / "branchy.onnx"
    onnx.save(branchy_model(np.random.default_rng(5)), model_path)
    feeds = {"x": np.random.default_rng(6).standard_normal((BATCH, WIDTH)).astype(np.float32)}
    built: dict[tuple[str, ...], Path] = {}

    def build(*flags: str) -> Path:
        if flags not in built:
            out = folder / f"out-{len(built)}"
            code, _, err = run_cli(["build", model_path, "--output", out, *SPLIT, *flags])
            assert code == 0, err
            built[flags] = out / "dag.json"
        return built[flags]
    return model_path, build, feeds


def run_node(tmp_path: Path, dag: Path, feeds: dict, num_threads: list[int], **flags) -> dict:
    """The check script's report, its outputs under tmp_path/out."""
    (tmp_path / "out").mkdir()
    (inputs,) = [r["inputs"] for r in write_requests(tmp_path, [{"inputs": feeds, "outputs": {}}])]
    job = {"dag": str(dag), "folder": str(tmp_path), "inputs": inputs, "out": str(tmp_path / "out"),
           "numThreads": num_threads, **flags}
    (tmp_path / "job.json").write_text(json.dumps(job))
    done = subprocess.run([NODE, "--experimental-wasm-relaxed-simd", str(CHECK), str(tmp_path / "job.json")],
                          capture_output=True, text=True, timeout=NODE_TIMEOUT_S, cwd=REPO_ROOT, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def output(tmp_path: Path, label: str) -> np.ndarray:
    return np.fromfile(tmp_path / "out" / f"{label}-y.bin", dtype=np.float32).reshape(BATCH, WIDTH)


def test_independent_branches_run_on_workers_with_the_bits_of_one_thread(tmp_path, branchy):
    model_path, build, feeds = branchy
    dag = build()
    report = run_node(tmp_path, dag, feeds, [1, 2, 3], no_shared_memory=True)
    (reference,) = run_onnxruntime(onnx.load(model_path), feeds).values()
    one = output(tmp_path, "n1")
    np.testing.assert_allclose(one, reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())
    assert report["runs"]["1"]["trace"]["threads"]["mode"] == "single"
    for n in (2, 3):
        np.testing.assert_array_equal(output(tmp_path, f"n{n}"), one, err_msg=f"numThreads {n}")
        trace = report["runs"][str(n)]["trace"]
        validate_trace(trace)
        threads = trace["threads"]
        assert (threads["mode"], threads["threads"], threads["walk"]) == ("cu-workers", n, "threaded"), threads
        ran_on = {entry["cu"]: entry["thread"] for entry in trace["cus"]}
        assert ran_on == threads["cu_thread"] and len(ran_on) == len(json.loads(dag.read_text())["cus"])
        assert len(set(ran_on.values())) == n, f"the branches should spread over all {n} threads: {ran_on}"
    assert report["shared_array_buffers"] == 0, "SharedArrayBuffer was constructed where it is withheld"


def chain_model(rng: np.random.Generator) -> onnx.ModelProto:
    """DEPTH * 2 MatMul + Relu one after the other: nothing in it can run at once."""
    nodes, weights, x = [], [], "x"
    for d in range(2 * DEPTH):
        w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"w{d}"))
        nodes += [helper.make_node("MatMul", [x, f"w{d}"], [f"m{d}"]), helper.make_node("Relu", [f"m{d}"], [f"r{d}"])]
        x = f"r{d}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, WIDTH])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_chain_on_two_threads_runs_on_the_calling_thread_and_says_why(tmp_path):
    model_path = tmp_path / "chain.onnx"
    onnx.save(chain_model(np.random.default_rng(7)), model_path)
    code, _, err = run_cli(["build", model_path, "--output", tmp_path / "build", *SPLIT])
    assert code == 0, err
    dag = tmp_path / "build" / "dag.json"
    assert len(json.loads(dag.read_text())["cus"]) > 1, "the chain should be several CUs"
    feeds = {"x": np.random.default_rng(8).standard_normal((BATCH, WIDTH)).astype(np.float32)}
    report = run_node(tmp_path, dag, feeds, [1, 2], no_shared_memory=True)
    np.testing.assert_array_equal(output(tmp_path, "n2"), output(tmp_path, "n1"))
    run = report["runs"]["2"]
    threads = run["trace"]["threads"]
    validate_trace(run["trace"])
    assert (threads["mode"], threads["threads"], threads["walk"]) == ("cu-workers", 2, "sequential"), threads
    assert "would save 0%" in threads["sequential_because"] and "a chain" in threads["sequential_because"], threads
    assert set(threads["cu_thread"].values()) == {0} and {e["thread"] for e in run["trace"]["cus"]} == {0}
    assert run["workers_started"] == 0, "a section whose CUs all stay here should start no worker"


def test_a_request_that_looks_up_the_cache_walks_sequentially_with_the_schedulers_skips(tmp_path, branchy):
    _, build, feeds = branchy
    plain = build()
    cached = build("--cache-inputs", "x")
    (tmp_path / "plain").mkdir()
    run_node(tmp_path / "plain", plain, feeds, [1])
    report = run_node(tmp_path, cached, feeds, [2], policy="balanced", release=True)
    threads = report["runs"]["2"]["trace"]["threads"]
    assert threads["walk"] == "sequential" and "result cache" in threads["sequential_because"], threads
    want = output(tmp_path / "plain", "n1")
    for label in ("n2", "n2-release"):
        np.testing.assert_array_equal(output(tmp_path, label), want, err_msg=label)


@pytest.mark.parametrize("fault", ["trap", "exit"])
def test_a_failing_worker_fails_the_request_in_one_line_naming_the_cu_and_the_next_works(tmp_path, branchy, fault):
    _, build, feeds = branchy
    report = run_node(tmp_path, build(), feeds, [2], fault=fault, release=True)
    run = report["runs"]["2"]
    message, cu = run["fault_error"], run["fault_cu"]
    assert message is not None and cu is not None
    assert "\n" not in message and message.startswith(f"{cu} ("), message
    assert ("trapped" if fault == "trap" else "CU worker 1 exited") in message, message
    want = output(tmp_path, "n2")
    for label in ("n2-fault", "n2-release"):       # a fresh worker; then workers started again
        np.testing.assert_array_equal(output(tmp_path, label), want, err_msg=label)


def test_a_bad_num_threads_is_one_line(branchy):
    _, build, _ = branchy
    script = ("import { InferenceSession } from './js/src/index.js';"
              f"try {{ await InferenceSession.create({json.dumps(str(build()))}, {{ numThreads: 0 }}); }}"
              " catch (e) { console.log(e.message); }")
    done = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True,
                          timeout=NODE_TIMEOUT_S, cwd=REPO_ROOT, check=False)
    assert done.stdout.strip() == "numThreads must be a whole number, at least 1 (got 0)", done.stdout + done.stderr


# In headless Chromium (as tests/test_js_threads_browser.py drives it). On a page that is not
# crossOriginIsolated, SharedArrayBuffer is a stub that counts and throws before the runtime loads.
NOT_ISOLATED_PAGE = """async ([numThreads, x, shape]) => {
  let made = 0;
  globalThis.SharedArrayBuffer = function SharedArrayBuffer() { made += 1; throw new TypeError("withheld"); };
  const { InferenceSession, Tensor } = await import("./cortex-runtime/index.js");
  try {
    const session = await InferenceSession.create("./dag.json", { numThreads, policy: "strict" });
    const { y } = await session.run({ x: new Tensor("float32", new Float32Array(x), shape) });
    const threads = session.lastTrace.threads;
    await session.release();
    return { y: Array.from(y.data), threads, made, isolated: crossOriginIsolated };
  } catch (e) {
    return { error: String(e?.message ?? e), made };
  }
}"""

NUM_THREADS_WORKER = """import { InferenceSession, Tensor } from "./cortex-runtime/index.js";
onmessage = async ({ data: { numThreads, x, shape } }) => {
  try {
    const session = await InferenceSession.create("./dag.json", { numThreads, policy: "strict" });
    const { y } = await session.run({ x: new Tensor("float32", new Float32Array(x), shape) });
    postMessage({ y: Array.from(y.data), threads: session.lastTrace.threads });
    await session.release();
  } catch (e) {
    postMessage({ error: String(e?.message ?? e) });
  }
};
"""

IN_WORKER = """async ([numThreads, x, shape]) => {
  const worker = new Worker("./num_threads_check.js", { type: "module" });
  const answer = await new Promise((resolve) => { worker.onmessage = (e) => resolve(e.data);
    worker.onerror = (e) => resolve({ error: String(e.message) }); worker.postMessage({ numThreads, x, shape }); });
  worker.terminate();
  return answer;
}"""


def bundled(tmp_path: Path, dag: Path) -> Path:
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert code == 0, err
    (site / "blank.html").write_text("<!doctype html><title>cu workers</title>")
    (site / "num_threads_check.js").write_text(NUM_THREADS_WORKER)
    return site


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="chromium is not installed")
def test_a_page_that_is_not_isolated_runs_cu_workers_without_shared_array_buffer(tmp_path, branchy):
    _, build, feeds = branchy
    dag = build()
    run_node(tmp_path, dag, feeds, [1])
    want = output(tmp_path, "n1")
    x = feeds["x"]
    (answer,) = evaluate(bundled(tmp_path, dag), False, [(NOT_ISOLATED_PAGE, [2, x.ravel().tolist(), list(x.shape)])])
    assert "error" not in answer, answer
    assert not answer["isolated"] and answer["made"] == 0, answer
    assert (answer["threads"]["mode"], answer["threads"]["walk"]) == ("cu-workers", "threaded"), answer["threads"]
    assert set(answer["threads"]["cu_thread"].values()) == {0, 1}
    np.testing.assert_array_equal(np.array(answer["y"], dtype=np.float32).reshape(want.shape), want)


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="chromium is not installed")
def test_an_isolated_page_runs_a_threads_build_on_kernel_threads(tmp_path, builds):
    dag, feeds = builds("matmul-rows", THREADS)
    (want,) = wasmtime_outputs(dag, feeds).values()
    (x,) = feeds.values()
    (answer,) = evaluate(bundled(tmp_path, dag), True, [(IN_WORKER, [2, x.ravel().tolist(), list(x.shape)])])
    assert "error" not in answer, answer
    threads = answer["threads"]
    assert (threads["mode"], threads["kernel_threads"]) == ("kernel-threads", 2) and threads["split_cus"], threads
    np.testing.assert_array_equal(np.array(answer["y"], dtype=np.float32).reshape(want.shape), want)
