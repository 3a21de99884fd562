"""RuntimeOptions: one object carries the runtime's settings from the CLI and `cortex.load` down to
the scheduler; it is checked once, where it is made, with errors that name the CLI's flag; the
CLI's runtime flags are its fields; the scheduler it asks for implements the Scheduler protocol."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cortex
from cli_helpers import assert_one_line_error, run_cli
from cortex.runtime.options import RayOptions, RuntimeOptions
from cortex.runtime.parallel import ThreadedScheduler
from cortex.runtime.scheduler import SequentialScheduler
from cortex.runtime.schedulers import Scheduler
from ir.errors import CortexError
from ir.options import flag_of, option_fields
from runtime_cases import WIDTH, build, two_output_model
from testdata import run_onnxruntime


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("options")
    model = two_output_model()
    feeds = {"x": np.random.default_rng(1).standard_normal((4, WIDTH)).astype(np.float32)}
    return build(model, out), model, feeds


@pytest.mark.parametrize("settings, message", [
    (dict(policy="fastest"), "--policy: unknown policy 'fastest'"),
    (dict(trust_threshold=1.5), "--trust-threshold must be in [0, 1]"),
    (dict(cache_bytes=-1), "--cache-bytes cannot be negative, got -1"),
    (dict(cache_bytes=1.5), "--cache-bytes must be a whole number of bytes, got 1.5"),
    (dict(threads=0), "--threads must be at least 1, got 0"),
    (dict(threads=True), "--threads must be a whole number of at least 1, got True"),
    (dict(memory_budget_mb=-1), "--memory-budget must be a positive number of MB, got -1"),
    (dict(memory_budget_mb=float("nan")), "--memory-budget must be a positive number of MB, got nan"),
    (dict(pins=["cu-0000"]), "--pin needs --memory-budget"),
    (dict(pins="cu-0000", memory_budget_mb=1), "--pin must be CU ids"),
    (dict(cu_timeout_ms=-5), "--cu-timeout-ms must be a number of milliseconds"),
    (dict(cu_load_timeout_s=0), "--cu-load-timeout-s must be a positive number of seconds, got 0"),
    (dict(specializations="sometimes"), "--specializations 'sometimes': expected one of lazy, eager"),
    (dict(executor="mpi"), "--executor mpi: expected local or ray"),
    (dict(address="127.0.0.1:1"), "--address names a Ray cluster: it needs --executor ray"),
    (dict(executor_options={"stages": 2}), "--executor-option sets the ray executor: it needs --executor ray"),
    (dict(executor="ray", executor_options={"stage": 2}), "unknown executor option 'stage' for the ray executor"),
    (dict(executor="ray", executor_options={"replicas": 0}), "the ray executor's replicas must be a whole number"),
    (dict(executor="ray", memory_budget_mb=8), "--memory-budget keeps this process's CUs resident"),
])
def test_a_bad_setting_is_one_error_naming_the_cli_flag(settings, message):
    with pytest.raises(CortexError) as raised:
        RuntimeOptions(**settings)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_options_are_checked_before_the_dag_is_read(tmp_path):
    with pytest.raises(CortexError, match="--threads must be at least 1"):
        cortex.load(tmp_path / "missing" / "dag.json", threads=0)


def test_construction_normalises_what_it_checks():
    options = RuntimeOptions(policy="aggressive", trust_threshold=0.5, memory_budget_mb=2, pins=["cu-0001"])
    assert options.policy.name == "aggressive" and options.policy.trust_threshold == 0.5
    assert options.pins == ("cu-0001",) and options.memory_budget_bytes == 2 << 20
    assert dataclasses.replace(options, threads=3).policy == options.policy      # replace checks again, same result
    ray = RuntimeOptions(executor="ray", executor_options={"stages": 2, "group": 1})
    assert ray.executor_options == RayOptions(stages=2, group=1) and ray.ray.stages == 2
    assert RuntimeOptions().executor_options is None and RuntimeOptions().ray == RayOptions()


def test_load_takes_options_or_keywords_and_keywords_replace_the_options(two_outputs):
    dag_path, model, feeds = two_outputs
    want = run_onnxruntime(model, feeds)
    by_keywords = cortex.load(dag_path, policy="strict", threads=1, cache_bytes=0)
    by_options = cortex.load(dag_path, options=RuntimeOptions(policy="strict", threads=1, cache_bytes=0))
    assert by_keywords.options == by_options.options
    mixed = cortex.load(dag_path, "wasm", "balanced", options=RuntimeOptions(policy="strict", threads=1), threads=2)
    assert mixed.options.policy.name == "balanced" and mixed.threads == 2
    for compiled in (by_keywords, by_options, mixed):
        got = compiled.run(feeds)
        for name in ("y1", "y2"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="unknown runtime option 'thread'"):
        cortex.load(dag_path, thread=2)


@pytest.mark.parametrize("settings, kind", [
    (dict(threads=1), SequentialScheduler),
    (dict(threads=2), ThreadedScheduler),
    (dict(threads=2, memory_budget_mb=64), SequentialScheduler),     # memory tiers walk in dag.json's order
])
def test_each_local_scheduler_is_a_scheduler_the_model_closes_and_reuses(two_outputs, settings, kind):
    dag_path, model, feeds = two_outputs
    compiled = cortex.load(dag_path, policy="strict", **settings)
    scheduler = compiled.scheduler
    assert type(scheduler) is kind
    for member in ("run", "run_many", "resident_bytes", "sandbox_events", "close"):
        assert callable(getattr(scheduler, member)), member
    assert set(scheduler.devices) == {"wasm"} and scheduler.cache is compiled.cache
    first = compiled.run(feeds)["y1"]
    assert scheduler.close() is False                 # a local scheduler stays usable after close
    compiled.close()
    assert compiled.scheduler is scheduler
    batch = compiled.run_many([feeds, {"x": -feeds["x"]}])
    np.testing.assert_array_equal(batch[0]["y1"], first)
    np.testing.assert_allclose(batch[1]["y1"], run_onnxruntime(model, {"x": -feeds["x"]})["y1"], rtol=1e-4, atol=1e-4)


def test_the_scheduler_protocol_names_what_the_model_calls():
    assert {"run", "run_many", "resident_bytes", "sandbox_events", "close"} <= set(dir(Scheduler))
    assert set(Scheduler.__annotations__) == {"devices", "cache"}


def test_cli_runtime_flags_are_the_option_fields(two_outputs):
    flags = {field.name: flag_of(field, spec) for field, spec in option_fields(RuntimeOptions)}
    code, out, err = run_cli(["run", "--help"], env={"COLUMNS": "200"})
    assert code == 0, err
    parts = [part for flag in flags.values() for part in flag.split("/")]     # --segments/--no-segments: two
    assert all(part in out for part in parts), [part for part in parts if part not in out]
    code, out, err = run_cli(["bench", "--help"], env={"COLUMNS": "200"})
    assert code == 0, err
    assert "--cache-bytes" not in out and "--pad-to-bucket" not in out and "--executor-option" in out
    assert "[default: strict]" in out                    # bench's own default policy
    code, out, err = run_cli(["serve", "--help"], env={"COLUMNS": "200"})
    assert code == 0, err
    assert "--pin " not in out and "--executor " not in out and "[default: auto]" in out


def test_cli_errors_come_from_the_options_in_the_same_words(two_outputs):
    dag_path, _, _ = two_outputs
    code, _, err = run_cli(["run", dag_path, "--example-inputs", "--executor-option", "stages"])
    assert_one_line_error(code, err, "--executor-option 'stages': expected KEY=VALUE")
    code, _, err = run_cli(["run", dag_path, "--example-inputs", "--memory-budget", "8", "--executor", "ray"])
    assert_one_line_error(code, err, "--memory-budget keeps this process's CUs resident")
    code, _, err = run_cli(["serve", dag_path, "--memory-budget", "-2"])
    assert_one_line_error(code, err, "--memory-budget must be a positive number of MB, got -2")
