"""Shape specializations load lazily: a load instantiates none of them, a request loads the one it
picks (once, however many first requests race for it), `specializations="eager"` loads them all,
and under a memory budget the specializations together stay within it."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest
from cli_helpers import assert_one_line_error, run_cli
from specialized_builds import WIDTH, build_in_process, chain_model

import cortex
from backends.wasm.sandbox import planned_bytes
from cortex.runtime.scheduler import SequentialScheduler
from ir.errors import CortexError

RTOL, ATOL = 1e-4, 1e-5
BATCHES = (2, 4, 8)
NAMES = [f"batch={b}" for b in BATCHES]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """(dag.json of the chain built for batch 2, 4 and 8, the model)."""
    root = tmp_path_factory.mktemp("lazy")
    model = chain_model(root / "chain.onnx")
    return build_in_process(model, root / "out", "--dim", "batch=" + ",".join(map(str, BATCHES))), model


def feed(batch: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(batch).standard_normal((batch, WIDTH)).astype(np.float32)}


def reference(model, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def only_output(results: dict) -> np.ndarray:
    [value] = results.values()
    return value


def test_a_lazy_load_loads_only_the_specialization_each_request_picks(chain):
    dag, model = chain
    loaded = cortex.load(dag)
    assert loaded.loaded_specializations() == []
    assert [spec["name"] for spec in loaded.inputs] == ["x"]        # the interface needs no CU loaded
    assert not any(m.loaded for m in loaded.models)
    np.testing.assert_allclose(only_output(loaded.run(feed(4))), reference(model, feed(4)), rtol=RTOL, atol=ATOL)
    assert loaded.specialization == "batch=4" and loaded.loaded_specializations() == ["batch=4"]
    assert [m.loaded for m in loaded.models] == [False, True, False]
    assert loaded.resident_bytes() == loaded.models[1].scheduler.resident_bytes() > 0
    for batch in BATCHES:
        np.testing.assert_allclose(only_output(loaded.run(feed(batch))), reference(model, feed(batch)),
                                   rtol=RTOL, atol=ATOL)
    assert loaded.loaded_specializations() == NAMES
    assert loaded.sandbox_events()["traps"] == 0


def test_eager_loads_every_specialization_at_load(chain):
    dag, model = chain
    eager = cortex.load(dag, specializations="eager")
    assert eager.loaded_specializations() == NAMES
    np.testing.assert_allclose(only_output(eager.run(feed(8))), reference(model, feed(8)), rtol=RTOL, atol=ATOL)
    with pytest.raises(CortexError, match="--specializations 'sometimes': expected one of lazy, eager"):
        cortex.load(dag, specializations="sometimes")


def test_concurrent_first_requests_load_their_specialization_once(chain, monkeypatch):
    dag, model = chain
    loads: list[str] = []
    original = SequentialScheduler.load

    def slow_load(scheduler, policy=None):
        loads.append(scheduler.dag["inputs"][0]["shape"][0])
        time.sleep(0.2)         # a wide window for a second thread to start loading too
        original(scheduler, policy)

    monkeypatch.setattr(SequentialScheduler, "load", slow_load)
    loaded = cortex.load(dag, threads=1)
    assert loads == []
    batches = [4, 4, 4, 2]
    barrier = threading.Barrier(len(batches))
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def request(slot: int, batch: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[slot] = only_output(loaded.run(feed(batch)))
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=request, args=(slot, b)) for slot, b in enumerate(batches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == len(batches)
    assert sorted(loads) == [2, 4]
    for slot, batch in enumerate(batches):
        np.testing.assert_allclose(results[slot], reference(model, feed(batch)), rtol=RTOL, atol=ATOL)


def footprints(dag_path) -> dict[str, int]:
    """Each specialization's planned bytes, every CU resident."""
    dag = json.loads(dag_path.read_text())
    return {s["name"]: sum(planned_bytes(cu["artifacts"]["wasm"]["memory"]) for cu in s["cus"])
            for s in dag["specializations"]}


def resident_sets(loaded) -> dict[str, int]:
    return {s["name"]: m.scheduler.residency.set.used() for s, m in zip(loaded.sections, loaded.models) if m.loaded}


def test_under_a_memory_budget_the_specializations_share_it(chain):
    dag, model = chain
    sizes = footprints(dag)
    budget = max(sizes.values())            # room for one specialization's CUs, not for two
    assert budget < sum(sorted(sizes.values())[:2])
    loaded = cortex.load(dag, memory_budget_mb=budget / 2**20, policy="strict")     # strict: every CU runs
    for batch in (2, 4, 8, 2):
        np.testing.assert_allclose(only_output(loaded.run(feed(batch))), reference(model, feed(batch)),
                                   rtol=RTOL, atol=ATOL)
        held = resident_sets(loaded)
        assert sum(held.values()) <= budget, held
        assert loaded.resident_bytes() <= budget
        others = sum(n for name, n in held.items() if name != loaded.specialization)
        memory = loaded.last_trace["memory"]
        # During the request its specialization held at most its share: the budget less the others'.
        assert memory["budget_bytes"] == budget - others
        assert memory["peak_resident_bytes"] + others <= budget
    # batch=2 ran first and again last: its CUs were evicted for the others' and loaded again, and
    # to make it room the least recently run specialization (batch=4) gave up all its CUs, then
    # batch=8 some: a CU at a time, not a whole specialization.
    memory = loaded.last_trace["memory"]
    assert memory["loads"] == len(loaded.chosen.dag["cus"]) and memory["evictions"] > 0
    held = resident_sets(loaded)
    assert held["batch=4"] == 0 and 0 < held["batch=8"] < sizes["batch=8"]


def test_the_cli_takes_specializations_and_refuses_a_bad_value_in_one_line(chain, tmp_path):
    dag, model = chain
    np.save(tmp_path / "x.npy", feed(8)["x"])
    budget_mb = max(footprints(dag).values()) / 2**20
    code, out, err = run_cli(["run", dag, "--input", f"x={tmp_path / 'x.npy'}", "--specializations", "eager",
                              "--memory-budget", repr(budget_mb), "--output", tmp_path / "y.npz", "--json"])
    assert code == 0, err
    assert json.loads(out)["memory"]["budget_bytes"] == budget_mb * 2**20
    np.testing.assert_allclose(only_output(dict(np.load(tmp_path / "y.npz"))), reference(model, feed(8)),
                               rtol=RTOL, atol=ATOL)
    code, out, err = run_cli(["bench", dag, "--specializations", "lazy", "--repeat", "1", "--warmup", "0", "--json"])
    assert code == 0, err
    assert json.loads(out)["peak_rss_mb"] > 0
    code, _, err = run_cli(["run", dag, "--example-inputs", "--specializations", "sometimes"])
    assert_one_line_error(code, err, "--specializations 'sometimes'", "lazy, eager")
