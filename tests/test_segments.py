"""Segments (cortex/runtime/plan.py, backends/wasm/segment.py): runs of CUs that need no host
decision run in one call into a generated driver module. Outputs are those of one call per CU
(and onnxruntime's) under every policy; the trace keeps an entry per CU; a long chain is driven
by several drivers (a module imports at most 100 memories); a CU that traps, times out or grows
its memory inside a segment is named, the store is rebuilt and the next request is right."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_helpers import run_cli
from runtime_cases import build
from test_sandbox import GROW_BOMB, INFINITE_LOOP, OOB, OUT_OF_BOUNDS, _relu_module, place_module

import cortex
from backends.wasm.device import WasmDevice
from backends.wasm.sandbox import planned_bytes
from backends.wasm.segment import MEMORIES_PER_DRIVER, driver_chunks, segment_copies
from cortex.runtime.plan import Segment
from cortex.runtime.trace import validate_trace
from ir.errors import CortexError
from samples.chain_models import matmul_relu_chain

WIDTH = 16
LENGTH = MEMORIES_PER_DRIVER + 12      # more CUs than one driver may import memories of


def chain_model(length: int, seed: int = 0) -> onnx.ModelProto:
    """x -> Relu -> (MatMul, Relu) x length: the Relu a CU of its own, then one CU per MatMul + Relu."""
    return matmul_relu_chain(length, WIDTH, rows=2, lead_relu=True, seed=seed, name="chain")


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    return build(chain_model(LENGTH), tmp_path_factory.mktemp("segments") / "chain")


@pytest.fixture
def chain_copy(chain, tmp_path) -> Path:
    return shutil.copytree(chain.parent, tmp_path / "chain") / "dag.json"


def _reference(dag_path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(dag_path.parent / "chain.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _input(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, WIDTH)).astype(np.float32)


def _segments(model) -> list[Segment]:
    plans = model._loaded_scheduler()._plans
    return [step for plan in plans.values() for step in plan.steps if isinstance(step, Segment)]


@pytest.mark.parametrize("policy", ["strict", "balanced", "aggressive"])
def test_a_chain_runs_as_one_segment_with_the_outputs_of_one_call_per_cu(chain, policy):
    dag = json.loads(chain.read_text())
    assert len(dag["cus"]) == LENGTH + 1
    segmented = cortex.load(chain, policy=policy, threads=1)
    per_cu = cortex.load(chain, policy=policy, threads=1, segments=False)
    for seed in range(3):
        x = _input(seed)
        got, expected = segmented.run({"x": x}), per_cu.run({"x": x})
        assert got.keys() == expected.keys()
        for name in got:
            np.testing.assert_array_equal(got[name], expected[name])
            np.testing.assert_allclose(got[name], _reference(chain, x), rtol=1e-5, atol=1e-6)
    (segment,) = _segments(segmented)
    assert [cu["id"] for cu in segment.cus] == dag["order"]
    assert _segments(per_cu) == []
    # The trace still has one entry per CU, in order, each saying it ran inside a segment.
    assert segmented.last_trace["activated_cus"] == dag["order"] == per_cu.last_trace["activated_cus"]
    assert all(entry["segment"] == LENGTH + 1 for entry in segmented.trace)
    assert segmented.last_trace["sandbox_stats"]["bytes_copied_between_cus"] == \
        per_cu.last_trace["sandbox_stats"]["bytes_copied_between_cus"] > 0
    validate_trace(segmented.last_trace)


def test_a_long_segment_is_driven_by_drivers_within_the_memory_limit(chain):
    model = cortex.load(chain, policy="strict", threads=1)
    model.run({"x": _input(0)})
    (segment,) = _segments(model)
    instances = [model.device.instances[cu["id"]] for cu in segment.cus]
    copies, external = segment_copies(instances)
    chunks = driver_chunks(len(instances), copies)
    assert len(chunks) >= 2 and external == {"x"}
    for chunk in chunks:
        touched = set(chunk) | {c.producer for c in copies if c.reader in chunk}
        assert len(touched) <= MEMORIES_PER_DRIVER
    assert [p for chunk in chunks for p in chunk] == list(range(len(instances)))


def test_the_result_cache_keys_only_what_is_marked_repeating(chain):
    """A dag.json that marks nothing caches nothing under balanced: the chain is one segment and
    no lookup happens, so a repeated request runs every CU again, with the same bits."""
    model = cortex.load(chain, policy="balanced", threads=1)
    x = _input(4)
    first, second = model.run({"x": x}), model.run({"x": x})
    assert all(np.array_equal(first[name], second[name]) for name in first)
    assert model.last_trace["skipped_cus"] == [] and model.last_trace["cache"]["hits"] == 0
    assert len(model.last_trace["activated_cus"]) == LENGTH + 1


def _hostile(dag_path: Path, position: int, body: str) -> str:
    """The CU at `position` of dag.json's order replaced by a module with its exports and memory
    that runs `body`; its id."""
    dag = json.loads(dag_path.read_text())
    cu_id = dag["order"][position]
    plan = next(cu for cu in dag["cus"] if cu["id"] == cu_id)["artifacts"]["wasm"]["memory"]
    pages = planned_bytes(plan) // 65536
    place_module(dag_path, cu_id, f'(module (memory (export "memory") {pages}) (func (export "run") {body}))')
    return cu_id


@pytest.mark.parametrize("body, fragment, counter, options", [
    (OUT_OF_BOUNDS, "trapped: out of bounds memory access", "traps", {}),
    (GROW_BOMB, "exceeded its memory limit", "memory_limit_hits", {}),
    (INFINITE_LOOP, "timed out", "timeouts", {"cu_timeout_ms": 200}),
], ids=["trap", "memory.grow bomb", "infinite loop"])
def test_a_failure_inside_a_segment_names_its_cu_and_the_store_is_rebuilt(chain_copy, body, fragment, counter,
                                                                          options):
    position = LENGTH - 5         # in the segment's last driver
    cu_id = _hostile(chain_copy, position, body)
    model = cortex.load(chain_copy, policy="strict", threads=1, **options)
    for _ in range(2):            # the rebuilt store fails the same way, naming the same CU
        with pytest.raises(CortexError, match=f"^{cu_id} \\(.*\\) {fragment}.*store was rebuilt"):
            model.run({"x": _input(0)})
    assert _segments(model)
    events = model.sandbox_events()
    assert events[counter] == 2 and events["rebuilt"] == 2


def test_after_a_trap_in_a_segment_the_rebuilt_store_answers_correctly(chain_copy):
    """The segment's first CU (the Relu) traps on a flagged input only: the request after the
    trap runs on a fresh store, its drivers built again, and matches onnxruntime."""
    dag = json.loads(chain_copy.read_text())
    relu = dag["order"][0]
    place_module(chain_copy, relu, _relu_module(next(cu for cu in dag["cus"] if cu["id"] == relu)["artifacts"]["wasm"]
                                                ["memory"]))
    model = cortex.load(chain_copy, policy="strict", threads=1)
    flagged = _input(1)
    flagged[0, 0] = OOB
    with pytest.raises(CortexError, match=f"^{relu} \\(Relu\\) trapped: out of bounds"):
        model.run({"x": flagged})
    x = _input(2)
    np.testing.assert_allclose(model.run({"x": x})[dag["outputs"][0]["name"]], _reference(chain_copy, x),
                               rtol=1e-5, atol=1e-6)
    assert _segments(model)[0].cus[0]["id"] == relu
    assert model.sandbox_events() == {"traps": 1, "timeouts": 0, "memory_limit_hits": 0, "rebuilt": 1}


def test_cortex_run_takes_no_segments(chain, tmp_path):
    x = _input(2)
    np.save(tmp_path / "x.npy", x)
    for flag in ("--segments", "--no-segments"):
        out = tmp_path / f"out{flag}.npz"
        code, _, err = run_cli(["run", chain, "--input", f"x={tmp_path / 'x.npy'}", "--output", out,
                                "--policy", "strict", "--threads", "1", flag])
        assert code == 0, err
        got = np.load(out)
        np.testing.assert_allclose(next(iter(got.values())), _reference(chain, x), rtol=1e-5, atol=1e-6)


def test_a_chain_of_1024_cus_runs_as_one_call(tmp_path):
    dag_path = build(chain_model(1024, seed=3), tmp_path / "chain")
    model = cortex.load(dag_path, policy="strict", threads=1)
    x = _input(5)
    got = model.run({"x": x})
    (segment,) = _segments(model)
    assert len(segment.cus) == 1025
    np.testing.assert_allclose(next(iter(got.values())), _reference(dag_path, x), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(next(iter(got.values())),
                                  next(iter(cortex.load(dag_path, policy="strict", threads=1,
                                                        segments=False).run({"x": x}).values())))


def test_a_module_planning_more_memory_than_the_store_allowed_raises_the_ceiling(chain):
    """A variant's module may plan more memory than any exact CU's, which set the one store's limit."""
    dag = json.loads(chain.read_text())
    device = WasmDevice(dag, chain)
    device.join_one_store()
    device._memory_ceiling = 65536            # below every CU's limit
    device.load(dag["cus"][:2])
    assert device._memory_ceiling > 65536 and len(device.instances) == 2
