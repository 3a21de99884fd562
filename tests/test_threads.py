"""The threaded scheduler: ready CUs run at once (their trace intervals overlap), with outputs,
skips, cache hits and fallbacks equal to the sequential walk's; --threads through the CLI."""

from __future__ import annotations

import gc
import json
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import assert_one_line_error, run_cli
from cortex.runtime import load
from cortex.runtime.parallel import ThreadedScheduler, machine_threads
from cortex.runtime.scheduler import SequentialScheduler
from cortex.runtime.trace import validate_trace
from ir.errors import CortexError
from runtime_cases import build, two_output_model
from testdata import run_onnxruntime

RNG = np.random.default_rng(0)
WIDE = 768


def two_long_branches() -> onnx.ModelProto:
    """y1 = x1 @ w1 @ w2 and y2 = x2 @ w3 @ w4: two independent chains of 768x768x768 MatMuls, long
    enough that the second thread starts while the first is still computing (two inputs: CUs
    reading one tensor would be merged as siblings)."""
    weights = [numpy_helper.from_array((RNG.standard_normal((WIDE, WIDE)) / 16).astype(np.float32), f"w{i}")
               for i in range(1, 5)]
    nodes = [helper.make_node("MatMul", ["x1", "w1"], ["a"], name="left1"),
             helper.make_node("MatMul", ["a", "w2"], ["y1"], name="left2"),
             helper.make_node("MatMul", ["x2", "w3"], ["b"], name="right1"),
             helper.make_node("MatMul", ["b", "w4"], ["y2"], name="right2")]
    graph = helper.make_graph(nodes, "two_branches", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [WIDE, WIDE]) for x in ("x1", "x2")],
                              [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [WIDE, WIDE]),
                               helper.make_tensor_value_info("y2", TensorProto.FLOAT, [WIDE, WIDE])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture(scope="module")
def branches(tmp_path_factory):
    model = two_long_branches()
    out = tmp_path_factory.mktemp("branches")
    dag_path = build(model, out)
    feeds = {name: RNG.standard_normal((WIDE, WIDE)).astype(np.float32) for name in ("x1", "x2")}
    np.savez(out / "x.npz", **feeds)
    return dag_path, out / "two_branches.onnx", feeds


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_outputs")
    # x marked repeating, so that both walks have cache hits to compare (a dag.json that marks
    # nothing caches nothing).
    return build(two_output_model(), out, cache_inputs=("x",))


def overlaps(a: dict, b: dict) -> bool:
    a_end, b_end = a["start_ms"] + a["seconds"] * 1e3, b["start_ms"] + b["seconds"] * 1e3
    return a["start_ms"] < b_end and b["start_ms"] < a_end


def test_independent_cus_run_at_the_same_time_on_two_threads(branches):
    dag_path, _, feeds = branches
    model = load(dag_path, threads=2, policy="strict")
    model.run(feeds)                  # the pool's threads start on first use
    first_level = json.loads(dag_path.read_text())["levels"][0]
    assert len(first_level) == 2
    # On a busy machine the OS may start the second thread late; a few requests (bounded) show
    # the overlap without any timing threshold.
    for _ in range(5):
        model.run(feeds)
        entries = {e["cu"]: e for e in model.last_trace["cus"]}
        left, right = (entries[cu] for cu in first_level)
        if overlaps(left, right):
            break
    assert overlaps(left, right), (left, right)
    # The calling thread runs the last CU that can start, the pool the other: one hand-off, not two.
    assert {left["thread"], right["thread"]} == {0, 1}
    validate_trace(model.last_trace)
    # Chrome trace events: one row per thread.
    assert {e["tid"] for e in model.last_trace["traceEvents"]} == {e["thread"] for e in model.last_trace["cus"]}


def test_a_thread_that_finishes_a_cu_goes_on_with_its_successor(branches):
    """Each thread takes the next ready CU itself: a chain stays on the thread that started it, and
    its second CU starts as soon as its first ends, not once the other thread is free to notice."""
    dag_path, _, feeds = branches
    model = load(dag_path, threads=2, policy="strict")
    dag = json.loads(dag_path.read_text())
    successor = {e["from"]: e["to"] for e in dag["edges"]}
    model.run(feeds)
    for _ in range(3):
        model.run(feeds)
        entries = {e["cu"]: e for e in model.last_trace["cus"]}
        for first in dag["levels"][0]:
            assert entries[successor[first]]["thread"] == entries[first]["thread"], entries
    assert {e["thread"] for e in entries.values()} == {0, 1}


def pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cortex-cu-")]


@pytest.mark.parametrize("failing", ["pool", "calling"])
def test_an_error_in_a_cu_reaches_the_caller_once_every_started_cu_has_finished(branches, failing):
    """A CU that fails on a pool thread or on the calling thread while the other thread's CU is
    still running: the error reaches the caller only once no thread runs a CU of the request."""
    dag_path, onnx_path, feeds = branches
    model = load(dag_path, threads=2, policy="strict")
    device = next(iter(model.scheduler.devices.values()))
    real_run, caller = device.run, threading.get_ident()
    inside, failed, lock = [0], [], threading.Lock()

    def run(cu, inputs):
        if (threading.get_ident() == caller) == (failing == "calling") and not failed:
            failed.append(cu["id"])
            raise CortexError(f"{cu['id']} failed on purpose")
        with lock:
            inside[0] += 1
        try:
            return real_run(cu, inputs)
        finally:
            with lock:
                inside[0] -= 1

    device.run = run
    with pytest.raises(CortexError, match="failed on purpose"):
        model.run(feeds)
    assert len(failed) == 1 and inside[0] == 0
    # The next request is whole: every CU runs again, on both threads, with onnxruntime's outputs.
    got = model.run(feeds)
    want = run_onnxruntime(onnx_path, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
    assert len(model.last_trace["cus"]) == 4 and {e["thread"] for e in model.last_trace["cus"]} == {0, 1}


def test_close_stops_the_pools_threads_and_a_later_request_starts_them_again(branches):
    dag_path, _, feeds = branches
    # Threads of earlier tests' collected models may still be on their way out: only new ones count.
    before = set(pool_threads())
    model = load(dag_path, threads=2, policy="strict")
    assert not set(pool_threads()) - before           # started at the first hand-off, not at load
    first = model.run(feeds)
    assert len(set(pool_threads()) - before) == 1     # threads=2: the calling thread and one worker
    model.close()
    assert not set(pool_threads()) - before
    again = model.run(feeds)
    for name in first:
        np.testing.assert_array_equal(again[name], first[name])
    model.close()
    model.close()                                     # a second close does nothing
    assert not set(pool_threads()) - before
    # A model dropped without close tells its threads to stop once it is collected.
    model = load(dag_path, threads=2, policy="strict")
    model.run(feeds)
    started = set(pool_threads()) - before
    del model
    gc.collect()
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t in started) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in started)


def test_threaded_outputs_equal_sequential_bit_for_bit_and_onnxruntime(branches):
    dag_path, onnx_path, feeds = branches
    sequential = load(dag_path, threads=1, policy="strict").run(feeds)
    threaded = load(dag_path, threads=2, policy="strict").run(feeds)
    want = run_onnxruntime(onnx_path, feeds)
    for name in ("y1", "y2"):
        np.testing.assert_array_equal(threaded[name], sequential[name])
        np.testing.assert_allclose(threaded[name], want[name], rtol=1e-4, atol=1e-4)


def test_a_cu_that_is_alone_ready_runs_on_the_calling_thread(two_outputs):
    model = load(two_outputs, threads=2, policy="strict")
    model.run({"x": np.ones((4, 8), np.float32)})
    first = json.loads(two_outputs.read_text())["order"][0]      # nothing else can run beside it
    assert next(e for e in model.last_trace["cus"] if e["cu"] == first)["thread"] == 0


def test_one_thread_is_the_sequential_walk(two_outputs):
    model = load(two_outputs, threads=1)
    assert type(model.scheduler) is SequentialScheduler
    model.run({"x": np.ones((4, 8), np.float32)})
    assert all("thread" not in e and "start_ms" not in e for e in model.last_trace["cus"])
    assert isinstance(load(two_outputs, threads=3).scheduler, ThreadedScheduler)
    assert load(two_outputs).threads == machine_threads() >= 1


@pytest.mark.parametrize("threads", [2, 4])
def test_skips_and_cache_hits_are_the_sequential_walks(two_outputs, threads):
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    runs = []
    for n in (1, threads):
        model = load(two_outputs, threads=n)
        first = model.run({"x": x}, outputs=["y1"])
        trace_first = model.last_trace
        again = model.run({"x": x})
        runs.append((first, again, trace_first, model.last_trace, model.cache.stats()))
    (first1, again1, t1a, t1b, stats1), (first2, again2, t2a, t2b, stats2) = runs
    np.testing.assert_array_equal(first1["y1"], first2["y1"])
    for name in ("y1", "y2"):
        np.testing.assert_array_equal(again1[name], again2[name])
    for key in ("activated_cus", "skipped_cus"):
        assert sorted(map(str, t1a[key])) == sorted(map(str, t2a[key]))
        assert sorted(map(str, t1b[key])) == sorted(map(str, t2b[key]))
    assert any(s["reason"] == "not needed" for s in t2a["skipped_cus"])
    assert any(s["reason"] == "cache hit" for s in t2b["skipped_cus"])
    assert stats1 == stats2


def test_threads_must_be_a_positive_count(two_outputs):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(CortexError, match="--threads must be (a whole number of )?at least 1"):
            load(two_outputs, threads=bad)


def test_cli_run_with_threads_writes_a_trace_with_threads(branches, tmp_path):
    dag_path, onnx_path, feeds = branches
    code, _, err = run_cli(["run", dag_path, "--input", dag_path.parent / "x.npz", "--threads", "2",
                              "--output", tmp_path / "o.npz", "--trace", tmp_path / "t.json", "--policy", "strict"])
    assert code == 0, err
    trace = json.loads((tmp_path / "t.json").read_text())
    validate_trace(trace)
    assert {e["thread"] for e in trace["cus"]} <= {0, 1, 2} and len(trace["cus"]) == 4
    got = np.load(tmp_path / "o.npz")
    want = run_onnxruntime(onnx_path, feeds)
    np.testing.assert_allclose(got["y1"], want["y1"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("command", ["run", "bench"])
def test_cli_threads_below_one_is_one_line_error(two_outputs, command):
    extra = ["--example-inputs"] if command == "run" else ["--repeat", "1", "--warmup", "0"]
    code, _, err = run_cli([command, two_outputs, *extra, "--threads", "0"])
    assert_one_line_error(code, err, "--threads must be at least 1, got 0")


def test_cli_bench_reports_its_threads(two_outputs):
    code, out, err = run_cli(["bench", two_outputs, "--repeat", "2", "--warmup", "0", "--threads", "2", "--json"])
    assert code == 0, err
    assert json.loads(out)["threads"] == 2
