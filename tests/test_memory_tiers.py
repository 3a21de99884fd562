"""Memory tiers: the resident CUs stay within --memory-budget, the least recently used CU is evicted
first and a pinned one never, the prefetcher loads the next CUs ahead of their turn and never one
that is known not to run, and the trace counts bytes loaded, evicted and wasted.

The models: a chain of six MatMul + Relu layers (one CU each, all the same size), and the If model
of test_conditional_cus.py (a condition computed by a CU, a branch CU on each side).
"""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import onnx
import pytest
from cli_helpers import assert_one_line_error, run_cli
from cuda_cases import compile_cuda_pipeline
from onnx import TensorProto, helper, numpy_helper
from runtime_cases import build
from test_conditional_cus import build as build_if
from test_conditional_cus import feeds_for, if_model
from testdata import run_onnxruntime

import cortex
from cortex.runtime.memory import MB, ResidentSet, choose_pins
from cortex.runtime.trace import validate_trace
from cortex.tools.calibrate import speed_record
from ir.errors import CortexError
from samples.cache import SampleModel

LAYERS, WIDTH = 6, 64


def chain_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, weights, previous = [], [], "x"
    for i in range(LAYERS):
        weights.append(numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 8).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [previous, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"h{i}"])]
        previous = f"h{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [1, WIDTH])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chain")
    dag_path = build(chain_model(), folder)
    return dag_path, json.loads(dag_path.read_text())


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    folder = tmp_path_factory.mktemp("if")
    # x marked repeating, so that a repeated request is all cache hits (a dag.json that marks
    # nothing caches nothing).
    build_if(folder, if_model("computed"), "--cache-inputs", "x")
    return folder


def feed() -> dict:
    return {"x": np.random.default_rng(1).standard_normal((1, WIDTH)).astype(np.float32)}


def footprints(model) -> dict[str, int]:
    return dict(model.scheduler.residency.set.footprints)


def logged(model) -> tuple[list[str], list[str]]:
    """The CUs the model's device loads and unloads from now on, in order (loads come from the
    prefetcher's thread)."""
    device, loads, unloads, lock = model.device, [], [], threading.Lock()
    load, unload = device.load, device.unload

    def logged_load(cus):
        with lock:
            loads.extend(cu["id"] for cu in cus)
        load(cus)

    def logged_unload(cu_id):
        unloads.append(cu_id)
        return unload(cu_id)
    device.load, device.unload = logged_load, logged_unload
    return loads, unloads


def budget_for(model, cus: float) -> float:
    """A budget in MB for `cus` CUs of the chain (all the same size)."""
    (size,) = set(footprints(model).values())
    return cus * size / MB


def test_budget_is_respected_and_outputs_equal_the_unconstrained_run(chain):
    dag_path, dag = chain
    unconstrained = cortex.load(dag_path, policy="strict")
    want = unconstrained.run(feed())
    expected = run_onnxruntime(dag_path.parent / "chain.onnx", feed())
    probe = cortex.load(dag_path, policy="strict", memory_budget_mb=100)
    for cus in (1, 2.5, 4):
        budget = budget_for(probe, cus)
        model = cortex.load(dag_path, policy="strict", memory_budget_mb=budget)
        for _ in range(3):
            got = model.run(feed())
            for name, value in want.items():
                assert np.array_equal(got[name], value)
                np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5)
            trace = model.last_trace
            validate_trace(trace)
            assert trace["activated_cus"] == dag["order"]
            assert all(entry["resident_total_bytes"] <= budget * MB for entry in trace["cus"]), trace["cus"]
            assert trace["memory"]["peak_resident_bytes"] <= budget * MB
            assert trace["memory"]["budget_bytes"] == int(budget * MB)
            assert model.scheduler.resident_bytes() <= budget * MB


def test_least_recently_used_goes_first():
    resident = ResidentSet(300, {"a": 100, "b": 100, "c": 100, "d": 100}, pins=set())
    for cu_id in "abc":
        resident.admit(cu_id)
    resident.touch("a")                       # b is now the least recently used, then c
    assert resident.victims(100, keep=set()) == ["b"]
    assert resident.victims(200, keep=set()) == ["b", "c"]
    assert resident.victims(200, keep={"c"}) == ["b", "a"]
    assert resident.victims(400, keep=set()) is None


def test_the_chain_evicts_in_order_and_prefetches_every_cu(chain):
    dag_path, dag = chain
    model = cortex.load(dag_path, policy="strict", memory_budget_mb=100)
    model = cortex.load(dag_path, policy="strict", memory_budget_mb=budget_for(model, 2.5))
    model.run(feed())
    loads, unloads = logged(model)
    model.run(feed())
    memory = model.last_trace["memory"]
    # Two CUs fit: each one runs while the next loads. The request starts by evicting the two CUs
    # the last one left (least recently used first) for the first two, then the one before goes.
    assert loads == dag["order"]
    assert unloads == dag["order"][-2:] + dag["order"][:-2]
    assert memory["prefetch_misses"] == 0
    assert memory["prefetch_hits"] == LAYERS and memory["already_resident"] == 0
    assert memory["bytes_loaded"] == sum(footprints(model)[c] for c in loads)
    assert memory["bytes_evicted"] == sum(footprints(model)[c] for c in unloads)
    assert memory["wasted_bytes"] == 0        # no conditional CU, no cache: every loaded CU ran


def test_an_evicted_cu_is_loaded_again_from_its_kept_module(chain, monkeypatch):
    """A reload instantiates the module compiled at the first load: no file is mapped or hashed,
    and the outputs stay those of the unconstrained run, bit for bit."""
    import backends.wasm.device as wasm_device

    dag_path, dag = chain
    want = cortex.load(dag_path, policy="strict").run(feed())
    probe = cortex.load(dag_path, policy="strict", memory_budget_mb=100)
    model = cortex.load(dag_path, policy="strict", memory_budget_mb=budget_for(probe, 2.5))
    model.run(feed())
    mapped = []
    load_module = wasm_device.load_module
    monkeypatch.setattr(wasm_device, "load_module", lambda *a, **k: mapped.append(a[4]) or load_module(*a, **k))
    loads, unloads = logged(model)
    got = model.run(feed())
    assert loads == dag["order"] and unloads and not mapped
    assert all(np.array_equal(got[k], v) for k, v in want.items())


def test_producers_of_tensors_still_to_be_read_stay_where_the_next_cu_fits(chain):
    """With room for the running CU, the producer of its input and the next CU, the producer is not
    evicted for a deeper prefetch: no tensor is copied to the host but the model's output."""
    dag_path, _ = chain
    probe = cortex.load(dag_path, policy="strict", memory_budget_mb=100)
    model = cortex.load(dag_path, policy="strict", memory_budget_mb=budget_for(probe, 3.5))
    copied, to_host = [], model.device.to_host
    model.device.to_host = lambda tensor: copied.append(tensor.shape) or to_host(tensor)
    for _ in range(2):
        copied.clear()
        model.run(feed())
        assert copied == [(1, WIDTH)]        # the output h5, copied out for the caller
        assert model.last_trace["memory"]["prefetch_misses"] == 0


def test_pinned_cus_are_never_evicted(chain):
    dag_path, dag = chain
    pinned = [dag["order"][1], dag["order"][4]]
    probe = cortex.load(dag_path, policy="strict", memory_budget_mb=100)
    model = cortex.load(dag_path, policy="strict", memory_budget_mb=budget_for(probe, 3.5), pins=pinned)
    want = cortex.load(dag_path, policy="strict").run(feed())
    loads, unloads = logged(model)
    for _ in range(3):
        got = model.run(feed())
        assert all(np.array_equal(got[k], v) for k, v in want.items())
        assert model.last_trace["memory"]["pinned_cus"] == sorted(pinned)
    assert unloads and not set(pinned) & set(unloads)
    assert not set(pinned) & set(loads)         # loaded once, at load
    assert all(model.device.resident_bytes(cu_id) > 0 for cu_id in pinned)


def test_a_budget_below_the_largest_cu_plus_pins_is_refused(chain):
    dag_path, dag = chain
    probe = cortex.load(dag_path, policy="strict", memory_budget_mb=100)
    with pytest.raises(CortexError, match="give at least"):
        cortex.load(dag_path, memory_budget_mb=budget_for(probe, 0.5))
    with pytest.raises(CortexError, match="2 pinned CUs"):
        cortex.load(dag_path, memory_budget_mb=budget_for(probe, 2.5), pins=dag["order"][:2])
    with pytest.raises(CortexError, match="unknown CU 'cu-9999'"):
        cortex.load(dag_path, memory_budget_mb=1, pins=["cu-9999"])
    with pytest.raises(CortexError, match="positive number"):
        cortex.load(dag_path, memory_budget_mb=0)


def test_the_untaken_branch_is_never_loaded(conditional):
    model = cortex.load(conditional / "dag.json", cache_bytes=0)
    branch = {cu["id"]: cu["activation"]["equals"] for cu in model.dag["cus"] if "activation" in cu}
    largest = max(footprints(cortex.load(conditional / "dag.json", memory_budget_mb=100)).values())
    model = cortex.load(conditional / "dag.json", cache_bytes=0, memory_budget_mb=1.01 * largest / MB)
    for sign in (1.0, -1.0, 1.0):
        loads, _ = logged(model)
        feeds = feeds_for("computed", sign, None)
        got = model.run(feeds)["y"]
        np.testing.assert_allclose(got, run_onnxruntime(conditional / "m.onnx", feeds)["y"], rtol=1e-5, atol=1e-5)
        trace = model.last_trace
        validate_trace(trace)
        skipped = {s["cu"] for s in trace["skipped_cus"]}
        assert skipped and skipped <= set(branch)
        assert not skipped & set(loads)
        assert trace["memory"]["wasted_bytes"] == 0


def test_wasted_bytes_are_the_loaded_cus_that_did_not_run(conditional):
    """Repeating a request under balanced makes every CU a cache hit: the ones the prefetcher
    loaded for it did not run, and each of their bytes counts as wasted."""
    sizes = footprints(cortex.load(conditional / "dag.json", memory_budget_mb=100))
    model = cortex.load(conditional / "dag.json", policy="balanced", memory_budget_mb=1.01 * max(sizes.values()) / MB)
    feeds = feeds_for("computed", 1.0, None)
    first = model.run(feeds)["y"]
    loads, _ = logged(model)
    again = model.run(feeds)["y"]
    trace = model.last_trace
    assert np.array_equal(first, again)
    assert {s["reason"] for s in trace["skipped_cus"]} >= {"cache hit"}
    assert loads, "the prefetcher loaded the first CU ahead of the request"
    assert trace["memory"]["wasted_bytes"] == sum(sizes[c] for c in loads if c not in trace["activated_cus"]) > 0


def test_hot_cus_from_calibrate_are_pinned_when_no_pins_are_given():
    cus = {"cu-0000": {"residency": {"hot": True}}, "cu-0001": {"residency": {"hot": False}},
           "cu-0002": {"residency": {"hot": True}}, "cu-0003": {}}
    sizes = {"cu-0000": 100, "cu-0001": 100, "cu-0002": 300, "cu-0003": 100}
    assert choose_pins(cus, sizes, 1000, None) == {"cu-0000", "cu-0002"}
    assert choose_pins(cus, sizes, 450, None) == {"cu-0002"}      # the largest hot CU first, as room allows
    assert choose_pins(cus, sizes, 1000, ["cu-0001"]) == {"cu-0001"}
    assert speed_record([0.001, 0.002, 0.003], 0.005, 4, 4)["hot"]
    assert not speed_record([0.010], 0.005, 4, 4)["hot"]            # runs slower than it loads
    assert not speed_record([0.001], 0.005, 3, 4)["hot"]            # not every feed ran it


def test_cli_memory_options(chain, tmp_path):
    dag_path, dag = chain
    np.savez(tmp_path / "x.npz", **feed())
    code, _, err = run_cli(["run", dag_path, "--input", tmp_path / "x.npz", "--memory-budget", "0.01"])
    assert_one_line_error(code, err, "--memory-budget", "is too small", "give at least")
    code, _, err = run_cli(["run", dag_path, "--input", tmp_path / "x.npz", "--pin", dag["order"][0]])
    assert_one_line_error(code, err, "--pin needs --memory-budget")
    code, _, err = run_cli(["run", dag_path, "--input", tmp_path / "x.npz", "--memory-budget", "1", "--pin", "cu-9999"])
    assert_one_line_error(code, err, "--pin", "unknown CU 'cu-9999'")
    code, _, err = run_cli(["bench", dag_path, "--memory-budget", "-1"])
    assert_one_line_error(code, err, "--memory-budget must be a positive number")
    assert not any(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_cli_run_and_bench_under_a_budget(chain, tmp_path):
    dag_path, dag = chain
    np.savez(tmp_path / "x.npz", **feed())
    code, out, err = run_cli(["run", dag_path, "--input", tmp_path / "x.npz", "--memory-budget", "0.2", "--pin",
                              dag["order"][2], "--output", tmp_path / "y.npz", "--trace", tmp_path / "t.json", "--json"])
    assert code == 0, err
    summary = json.loads(out)
    assert summary["memory"]["budget_bytes"] == int(0.2 * MB) and summary["memory"]["pinned_cus"] == [dag["order"][2]]
    with np.load(tmp_path / "y.npz") as got:
        want = run_onnxruntime(dag_path.parent / "chain.onnx", feed())
        np.testing.assert_allclose(got["h5"], want["h5"], rtol=1e-5, atol=1e-5)
    validate_trace(json.loads((tmp_path / "t.json").read_text()))

    code, out, err = run_cli(["bench", dag_path, "--memory-budget", "0.2", "--repeat", "3", "--warmup", "1", "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["policy"] == "strict" and report["min_ms"] <= report["median_ms"] and report["peak_rss_mb"] > 0
    memory = report["memory"]
    assert memory["budget_bytes"] == int(0.2 * MB) and memory["wasted_bytes"] == 0
    assert memory["prefetch_hits"] + memory["already_resident"] == 3 * LAYERS
    assert memory["peak_resident_bytes"] <= 0.2 * MB


def test_the_onnxruntime_device_honours_the_budget_too(chain):
    dag_path, _ = chain
    want = cortex.load(dag_path, device="onnxruntime", policy="strict").run(feed())
    probe = cortex.load(dag_path, device="onnxruntime", policy="strict", memory_budget_mb=100)
    sizes = footprints(probe)
    budget = 2.5 * max(sizes.values()) / MB
    model = cortex.load(dag_path, device="onnxruntime", policy="strict", memory_budget_mb=budget)
    for _ in range(2):
        got = model.run(feed())
        assert all(np.array_equal(got[k], v) for k, v in want.items())
        assert all(entry["resident_total_bytes"] <= budget * MB for entry in model.last_trace["cus"])
        assert model.last_trace["memory"]["evictions"] > 0
    assert len(model.device.sessions) <= 2


@pytest.mark.slow
def test_cuda_sim_honours_the_budget(tmp_path):
    onnx.save(chain_model(), tmp_path / "chain.onnx")
    dag_path = compile_cuda_pipeline(SampleModel("chain", tmp_path / "chain.onnx", feed(), {}), tmp_path,
                                     min_cu_size=0, max_cu_depth=1)
    want = cortex.load(dag_path, device="cuda-sim", policy="strict").run(feed())
    sizes = footprints(cortex.load(dag_path, device="cuda-sim", policy="strict", memory_budget_mb=100))
    budget = 2.5 * max(sizes.values()) / MB
    model = cortex.load(dag_path, device="cuda-sim", policy="strict", memory_budget_mb=budget)
    for _ in range(2):
        got = model.run(feed())
        assert all(np.array_equal(got[k], v) for k, v in want.items())
        trace = model.last_trace
        assert all(entry["resident_total_bytes"] <= budget * MB for entry in trace["cus"])
        assert trace["memory"]["evictions"] > 0 and trace["memory"]["prefetch_misses"] == 0
        # The footprint announced before loading is what the loaded CU reports.
        assert trace["memory"]["bytes_loaded"] == trace["memory"]["loads"] * max(sizes.values())


def test_a_load_that_fails_in_the_prefetcher_is_reported_by_the_request(chain, tmp_path):
    dag_path, dag = chain
    shutil.copytree(dag_path.parent, tmp_path / "model")
    model = cortex.load(tmp_path / "model" / "dag.json", policy="strict", memory_budget_mb=0.2)
    module = tmp_path / "model" / dag["cus"][3]["artifacts"]["wasm"]["path"]
    module.write_bytes(module.read_bytes() + b"\0")
    for _ in range(2):      # the model stays usable: the same clear error each time, no hang
        with pytest.raises(CortexError, match="sha256 differs"):
            model.run(feed())
