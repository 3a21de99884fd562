"""The sandbox per CU on the wasm device: hostile, test-only modules placed as a CU of a real
compiled dag are stopped (an infinite loop at its deadline, a memory.grow bomb at its memory limit,
an out-of-bounds access at its trap), reported as one line naming the CU and its ops, counted in
the trace, and the same model then runs a normal request correctly; a load past its timeout is one
clear error too."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import wasmtime
from cli_helpers import assert_one_line_error, run_cli
from runtime_cases import build, two_output_model

import backends.wasm.device as wasm_device
import cortex
from backends.limits import AUTO_DEADLINE, CU_LOAD_TIMEOUT_S, no_sandbox_events, sandbox_limits
from backends.wasm.sandbox import (
    DEADLINE_FLOOR_MS,
    deadline_ms,
    memory_limit,
    planned_bytes,
)
from cortex.runtime.trace import validate_trace
from ir.errors import CortexError
from ir.fs import sha256_bytes

FAST_TIMEOUT_MS = 200
HOSTILE_CU = "cu-0000"        # the model's Relu: x (4x8 float32) -> h
LOOP, GROW, OOB = 1001.0, 1002.0, 1003.0     # x[0, 0] that turns the flagged module hostile


def _relu_module(plan: dict, hostile_body: str | None = None) -> str:
    """WAT with a CU module's exports and memory layout: Relu of the plan's input into its output,
    except that x[0, 0] equal to a flag first runs that flag's hostile code. With `hostile_body`,
    the module runs that and nothing else."""
    pages = planned_bytes(plan) // 65536
    x, h = plan["inputs"][0]["offset"], plan["outputs"][0]["offset"]
    if hostile_body is not None:
        return f'(module (memory (export "memory") {pages}) (func (export "run") {hostile_body}))'
    return f'''(module
  (memory (export "memory") {pages})
  (func (export "run") (local $i i32) (local $first f32)
    (local.set $first (f32.load (i32.const {x})))
    (if (f32.eq (local.get $first) (f32.const {LOOP})) (then {INFINITE_LOOP}))
    (if (f32.eq (local.get $first) (f32.const {GROW})) (then {GROW_BOMB}))
    (if (f32.eq (local.get $first) (f32.const {OOB})) (then {OUT_OF_BOUNDS}))
    (loop $each
      (f32.store (i32.add (i32.const {h}) (local.get $i))
                 (f32.max (f32.load (i32.add (i32.const {x}) (local.get $i))) (f32.const 0)))
      (local.set $i (i32.add (local.get $i) (i32.const 4)))
      (br_if $each (i32.lt_u (local.get $i) (i32.const {plan["inputs"][0]["bytes"]}))))))'''


INFINITE_LOOP = "(loop $spin (br $spin))"
# Grows a page at a time until the store refuses (memory.grow returns -1), then returns normally.
GROW_BOMB = "(block $done (loop $more (br_if $done (i32.eq (memory.grow (i32.const 1)) (i32.const -1))) (br $more)))"
OUT_OF_BOUNDS = "(drop (i32.load (i32.const 0x7ffffff0)))"
HOSTILE = {"infinite loop": (INFINITE_LOOP, "timed out"),
           "memory.grow bomb": (GROW_BOMB, "exceeded its memory limit"),
           "out-of-bounds access": (OUT_OF_BOUNDS, "out of bounds memory access")}


def place_module(dag_path: Path, cu_id: str, wat: str) -> None:
    """Replace the CU's .wasm with `wat` assembled, and record its sha256 and size in dag.json."""
    dag = json.loads(dag_path.read_text())
    record = next(cu for cu in dag["cus"] if cu["id"] == cu_id)["artifacts"]["wasm"]
    code = bytes(wasmtime.wat2wasm(wat))
    (dag_path.parent / record["path"]).write_bytes(code)
    record["sha256"], record["bytes"] = sha256_bytes(code), len(code)
    dag_path.write_text(json.dumps(dag, indent=2))


def _plan(dag_path: Path, cu_id: str = HOSTILE_CU) -> dict:
    dag = json.loads(dag_path.read_text())
    return next(cu for cu in dag["cus"] if cu["id"] == cu_id)["artifacts"]["wasm"]["memory"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    return build(two_output_model(), tmp_path_factory.mktemp("sandbox") / "model")


@pytest.fixture
def dag_copy(compiled, tmp_path) -> Path:
    folder = shutil.copytree(compiled.parent, tmp_path / "model")
    return folder / "dag.json"


@pytest.fixture(scope="module")
def reference(compiled):
    session = ort.InferenceSession(str(compiled.parent / "two_outputs.onnx"), providers=["CPUExecutionProvider"])
    return lambda x: dict(zip(["y1", "y2"], session.run(["y1", "y2"], {"x": x})))


def _normal_input(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)


def _flagged(flag: float) -> np.ndarray:
    x = _normal_input(1)
    x[0, 0] = flag
    return x


def _assert_matches(model, reference, x) -> None:
    got = model.run({"x": x})
    for name, expected in reference(x).items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5)


def test_each_hostile_request_is_stopped_and_the_model_then_answers_correctly(dag_copy, reference):
    place_module(dag_copy, HOSTILE_CU, _relu_module(_plan(dag_copy)))
    model = cortex.load(dag_copy, policy="strict", cu_timeout_ms=FAST_TIMEOUT_MS)
    validate_trace(model.last_trace)                              # before the first request
    _assert_matches(model, reference, _normal_input())           # the flagged module is a correct Relu
    for flag, (_, fragment) in zip((LOOP, GROW, OOB), HOSTILE.values()):
        with pytest.raises(CortexError) as failed:
            model.run({"x": _flagged(flag)})
        message = str(failed.value)
        assert message.startswith(f"{HOSTILE_CU} (Relu) ") and fragment in message, message
        assert "\n" not in message
        _assert_matches(model, reference, _normal_input(int(flag)))   # on the rebuilt store
    stats = model.last_trace["sandbox_stats"]
    assert {k: stats[k] for k in no_sandbox_events()} == {"traps": 1, "timeouts": 1, "memory_limit_hits": 1,
                                                         "rebuilt": 3}
    validate_trace(model.last_trace)
    assert model.device.instances[HOSTILE_CU].memory_bytes() == planned_bytes(_plan(dag_copy))


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_cu_fails_cortex_run_with_one_line(dag_copy, tmp_path, kind):
    body, fragment = HOSTILE[kind]
    place_module(dag_copy, HOSTILE_CU, _relu_module(_plan(dag_copy), body))
    out = tmp_path / "out.npz"
    code, _, err = run_cli(["run", dag_copy, "--example-inputs", "--output", out,
                            "--cu-timeout-ms", FAST_TIMEOUT_MS])
    assert_one_line_error(code, err, f"{HOSTILE_CU} (Relu)", fragment)
    assert not out.exists()


def test_a_hostile_cu_is_rebuilt_after_each_failure_in_process(dag_copy):
    place_module(dag_copy, HOSTILE_CU, _relu_module(_plan(dag_copy), OUT_OF_BOUNDS))
    model = cortex.load(dag_copy, cu_timeout_ms=FAST_TIMEOUT_MS)
    for _ in range(3):
        with pytest.raises(CortexError, match="cu-0000 \\(Relu\\) trapped: out of bounds memory access"):
            model.run({"x": _normal_input()})
    assert model.sandbox_events() == {"traps": 3, "timeouts": 0, "memory_limit_hits": 0, "rebuilt": 3}


def test_the_auto_deadline_comes_from_the_cost_estimate_and_stops_a_loop(dag_copy):
    place_module(dag_copy, HOSTILE_CU, _relu_module(_plan(dag_copy), INFINITE_LOOP))
    dag = json.loads(dag_copy.read_text())
    relu = dag["cus"][0]
    assert deadline_ms(relu, _plan(dag_copy), cortex.load(dag_copy).limits) is None     # the default: no limit
    auto = sandbox_limits(AUTO_DEADLINE)
    assert deadline_ms(relu, _plan(dag_copy), auto) == DEADLINE_FLOOR_MS   # a tiny CU
    big = {**relu, "flops": 10**12}     # a teraflop at the nominal 1 GFLOP/s: 1000 s, times the factor
    assert deadline_ms(big, _plan(dag_copy), auto) > 1000 * DEADLINE_FLOOR_MS
    model = cortex.load(dag_copy, cu_timeout_ms=AUTO_DEADLINE)
    with pytest.raises(CortexError, match=f"deadline of {DEADLINE_FLOOR_MS:g} ms"):
        model.run({"x": _normal_input()})
    assert model.sandbox_events()["timeouts"] == 1


def test_the_memory_limit_is_the_plan_plus_one_page():
    plan = {"memory_bytes": 65537}
    assert planned_bytes(plan) == 2 * 65536 and memory_limit(plan) == 3 * 65536


def test_a_module_declaring_more_memory_than_its_plan_is_refused_at_load(dag_copy):
    place_module(dag_copy, HOSTILE_CU, '(module (memory (export "memory") 64) (func (export "run")))')
    with pytest.raises(CortexError, match="cu-0000 cannot be instantiated under its memory limit of 131072 bytes"):
        cortex.load(dag_copy)


def test_no_time_limit_runs_without_epoch_checks(compiled, reference):
    model = cortex.load(compiled, cu_timeout_ms=0)
    assert model.device.instances[HOSTILE_CU].deadline_ticks is None
    _assert_matches(model, reference, _normal_input())


def test_a_load_past_its_timeout_is_one_error_and_leaves_nothing_behind(dag_copy, monkeypatch):
    release = threading.Event()
    original = wasm_device.load_module

    def slow_load(*args, **kwargs):
        release.wait(timeout=10)          # bounded: the test releases it below
        return original(*args, **kwargs)

    monkeypatch.setattr(wasm_device, "load_module", slow_load)
    with pytest.raises(CortexError, match="cu-0000 \\(Relu\\): loading took longer than the CU load timeout of 0.2 s"):
        cortex.load(dag_copy, cu_load_timeout_s=0.2)
    release.set()
    monkeypatch.setattr(wasm_device, "load_module", original)
    assert cortex.load(dag_copy).run({"x": _normal_input()})["y1"].shape == (4, 8)
    assert CU_LOAD_TIMEOUT_S == cortex.load(dag_copy).limits.cu_load_timeout_s


@pytest.mark.slow     # a cortex subprocess of its own; the in-process tests cover the rule
def test_a_cold_load_past_its_timeout_fails_cortex_run_and_writes_no_cache(dag_copy):
    bins = dag_copy.parent / "wasm-bin"
    for cached in bins.glob("*.cwasm"):
        cached.unlink()
    before = sorted(p.name for p in bins.iterdir())
    code, _, err = run_cli(["run", dag_copy, "--example-inputs", "--cu-load-timeout-s", "0.00001"])
    assert_one_line_error(code, err, "cu-0000 (Relu)", "CU load timeout", "--cu-load-timeout-s")
    assert sorted(p.name for p in bins.iterdir()) == before


@pytest.mark.slow     # cortex subprocesses; test_bad_sandbox_keywords_are_errors covers the rule in-process
@pytest.mark.parametrize("argv, fragment", [
    (["run", "--example-inputs", "--cu-timeout-ms", "-1"], "--cu-timeout-ms"),
    (["bench", "--cu-load-timeout-s", "0"], "--cu-load-timeout-s"),
])
def test_bad_sandbox_options_are_one_line_errors(compiled, argv, fragment):
    code, _, err = run_cli([argv[0], compiled, *argv[1:]])
    assert_one_line_error(code, err, fragment)


def test_bad_sandbox_keywords_are_errors(compiled):
    # RuntimeOptions names an option as the CLI spells it, whoever made the options.
    with pytest.raises(CortexError, match="--cu-timeout-ms must be a number of milliseconds.*got -5"):
        cortex.load(compiled, cu_timeout_ms=-5)
    with pytest.raises(CortexError, match="--cu-load-timeout-s must be a positive number of seconds"):
        cortex.load(compiled, cu_load_timeout_s=0)


@pytest.mark.slow     # a cortex subprocess of its own; the in-process tests cover the rule
def test_cortex_bench_takes_the_sandbox_options(compiled):
    code, out, err = run_cli(["bench", compiled, "--repeat", "2", "--warmup", "0", "--json", "--cu-timeout-ms", "5000",
                              "--cu-load-timeout-s", "60"])
    assert code == 0, err
    assert json.loads(out)["runs"] == 2


def test_a_start_function_that_never_ends_is_stopped_at_the_load_timeout(dag_copy):
    plan = _plan(dag_copy)
    place_module(dag_copy, HOSTILE_CU, f'(module (memory (export "memory") {planned_bytes(plan) // 65536}) '
                                       f'(func $spin {INFINITE_LOOP}) (start $spin) (func (export "run")))')
    with pytest.raises(CortexError, match="cu-0000"):
        cortex.load(dag_copy, cu_load_timeout_s=0.3, cu_timeout_ms=AUTO_DEADLINE)
    # The abandoned worker is not left spinning: its start function ran under the same time limit.
    for _ in range(100):
        if not any(t.name == "cortex-cu-load" and t.is_alive() for t in threading.enumerate()):
            break
        threading.Event().wait(0.05)
    assert not any(t.name == "cortex-cu-load" and t.is_alive() for t in threading.enumerate())


def test_a_forked_child_stops_a_loop_at_its_deadline(dag_copy):
    """A server's worker process inherits the model; its deadlines still fire."""
    place_module(dag_copy, HOSTILE_CU, _relu_module(_plan(dag_copy)))
    model = cortex.load(dag_copy, cu_timeout_ms=FAST_TIMEOUT_MS)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:      # the child reports through the pipe and never returns into pytest
        try:
            model.run({"x": _flagged(LOOP)})
            verdict = b"ran"
        except CortexError as e:
            verdict = b"timed out" if "timed out" in str(e) else b"other"
        os.write(write, verdict)
        os._exit(0)
    os.close(write)
    for _ in range(300):           # bounded: a child whose deadline never fires is killed
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's loop was not stopped within 30 s")
    assert os.read(read, 64) == b"timed out" and status == 0


def test_a_store_whose_rebuild_fails_is_rebuilt_on_the_next_call(dag_copy, monkeypatch, reference):
    place_module(dag_copy, HOSTILE_CU, _relu_module(_plan(dag_copy)))
    model = cortex.load(dag_copy, policy="strict", cu_timeout_ms=FAST_TIMEOUT_MS)
    device = model.device
    working = device._instantiate

    def refusing(sandboxed, *rest):
        raise wasmtime.WasmtimeError("out of memory on this host")
    monkeypatch.setattr(device, "_instantiate", refusing)
    with pytest.raises(CortexError, match="trapped: out of bounds .*; rebuilding (cu-0000's|the model's) store failed"):
        model.run({"x": _flagged(OOB)})
    monkeypatch.setattr(device, "_instantiate", working)
    _assert_matches(model, reference, _normal_input())
    assert model.sandbox_events() == {"traps": 1, "timeouts": 0, "memory_limit_hits": 0, "rebuilt": 1}
