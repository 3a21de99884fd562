"""`--device hybrid`: CUs placed on wasm or on the GPU by their flops, with cuda-sim standing in for
the GPU (`hybrid-sim`). The outputs equal the single-device runs, the trace says where each CU ran
and what crossed the border, and a bad threshold is one line. `cortex calibrate --hybrid` records
the measured crossover in dag.json and the next load places by it."""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnxruntime as ort
import pytest
from cli_helpers import assert_one_line_error, run_cli
from testdata import sample_model

from backends.hybrid import DEFAULT_GPU_MIN_FLOPS, THRESHOLD_VARIABLE, placer
from cortex.dag import validate_dag
from cortex.tools.crossover import crossover_threshold

RNG = np.random.default_rng(3)


def test_placement_follows_flops_and_the_artifacts_there_are(monkeypatch):
    both = {"wasm": {}, "cuda": {}}
    monkeypatch.setenv(THRESHOLD_VARIABLE, "1000")
    place = placer("cuda-sim")
    assert place({"flops": 999, "artifacts": both}) == "wasm"
    assert place({"flops": 1000, "artifacts": both}) == "cuda-sim"
    assert place({"flops": 10**9, "artifacts": {"wasm": {}}}) == "wasm"
    assert place({"flops": 10**9, "artifacts": {"cuda": {}}}) == "cuda-sim"
    assert place({"flops": 0, "artifacts": {"cuda": {}}}) == "onnxruntime"   # no wasm build: onnxruntime
    monkeypatch.delenv(THRESHOLD_VARIABLE)
    assert placer("cuda")({"flops": DEFAULT_GPU_MIN_FLOPS, "artifacts": both}) == "cuda"


def _decomposed(tmp_path):
    case = sample_model("mlp")
    cus, dag = tmp_path / "cus", tmp_path / "dag.json"
    assert run_cli(["decompose", "--model-path", case.path, "--output-dir", cus, "--dim", "batch=32",
                    "--min-cu-size", "16", "--max-cu-depth", "1"])[0] == 0
    assert run_cli(["build-dag", "--cu-dir", cus, "--output", dag])[0] == 0
    return case, cus, dag


def test_a_bad_threshold_is_one_line(tmp_path):
    _, _, dag = _decomposed(tmp_path)
    code, _, err = run_cli(["run", dag, "--device", "hybrid-sim", "--example-inputs"], env={THRESHOLD_VARIABLE: "lots"})
    assert_one_line_error(code, err, THRESHOLD_VARIABLE, "'lots'")


@pytest.mark.slow
def test_hybrid_outputs_equal_single_device_runs_and_the_trace_shows_the_border(tmp_path):
    case, cus, dag = _decomposed(tmp_path)
    assert run_cli(["compile-wasm", "--cu-dir", cus, "--dag", dag, "--output", tmp_path / "wasm-bin"])[0] == 0
    assert run_cli(["compile-cuda", "--cu-dir", cus, "--dag", dag, "--output", tmp_path / "cuda-bin",
                    "--compiler", "nvrtc", "--arch", "sm_90"])[0] == 0
    flops = {cu["id"]: cu["flops"] for cu in json.loads(dag.read_text())["cus"]}
    assert len(set(flops.values())) > 1
    threshold = max(flops.values())          # only the heaviest CU goes to the "GPU"
    x = RNG.standard_normal((32, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    outputs = {}
    for device in ("hybrid-sim", "wasm", "cuda-sim"):
        out, trace = tmp_path / f"{device}.npz", tmp_path / f"{device}.json"
        code, _, err = run_cli(["run", dag, "--device", device, "--input", f"x={tmp_path / 'x.npy'}",
                                "--output", out, "--trace", trace], env={THRESHOLD_VARIABLE: str(threshold)})
        assert code == 0, err
        with np.load(out) as got:
            outputs[device] = dict(got)
        if device == "hybrid-sim":
            entries = json.loads(trace.read_text())["cus"]
    where = {e["cu"]: e["device"] for e in entries}
    assert where == {cu: "cuda-sim" if f >= threshold else "wasm" for cu, f in flops.items()}
    # A tensor crosses wherever the device changes from one CU to the next, never elsewhere.
    order = [e["cu"] for e in entries]
    for before, after in itertools.pairwise(order):
        crossed = next(e for e in entries if e["cu"] == after)["bytes_from_other_devices"]
        assert (crossed > 0) == (where[before] != where[after])
    want = ort.InferenceSession(str(case.path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for name, value in outputs["hybrid-sim"].items():
        np.testing.assert_allclose(value, outputs["wasm"][name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(value, outputs["cuda-sim"][name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-5)


def _record(device: str, threshold: int | None) -> dict:
    return {"hybrid": {"device": device, "crossover_flops": threshold, "measured_on": "2026-01-01T00:00:00Z",
                       "repeats": 1, "cus": {}}}


def test_a_recorded_crossover_places_its_own_gpu_device_and_the_variable_overrides_it(monkeypatch):
    both = {"wasm": {}, "cuda": {}}
    monkeypatch.delenv(THRESHOLD_VARIABLE, raising=False)
    measured = _record("cuda-sim", 5000)
    assert placer("cuda-sim", measured)({"flops": 4999, "artifacts": both}) == "wasm"
    assert placer("cuda-sim", measured)({"flops": 5000, "artifacts": both}) == "cuda-sim"
    # A simulator's timings say nothing about a GPU: `hybrid` keeps the default.
    assert placer("cuda", measured)({"flops": DEFAULT_GPU_MIN_FLOPS, "artifacts": both}) == "cuda"
    assert placer("cuda", measured)({"flops": 5000, "artifacts": both}) == "wasm"
    # The GPU won nowhere: every CU stays on the CPU, however heavy.
    assert placer("cuda-sim", _record("cuda-sim", None))({"flops": 10**12, "artifacts": both}) == "wasm"
    monkeypatch.setenv(THRESHOLD_VARIABLE, "0")
    assert placer("cuda-sim", _record("cuda-sim", None))({"flops": 1, "artifacts": both}) == "cuda-sim"


def test_the_crossover_is_where_the_gpu_wins_on_nearly_every_cu_above_it():
    assert crossover_threshold([(10, 2.0, 1.0), (100, 1.0, 2.0), (1000, 1.0, 3.0)]) == 100
    assert crossover_threshold([(10, 0.5, 1.0), (100, 2.0, 1.0), (1000, 1.0, 3.0)]) == 1000
    assert crossover_threshold([(10, 0.5, 1.0), (1000, 2.0, 1.0)]) is None     # the heaviest CU lost
    assert crossover_threshold([]) is None


def test_calibrating_the_crossover_without_cuda_artifacts_or_off_hybrid_is_one_line(tmp_path):
    _, _, dag = _decomposed(tmp_path)
    before = dag.read_bytes()
    code, _, err = run_cli(["calibrate", dag, "--hybrid", "--device", "hybrid-sim"])
    assert_one_line_error(code, err, str(dag), "no CU has a cuda artifact", "compile-cuda")
    code, _, err = run_cli(["calibrate", dag, "--hybrid", "--device", "wasm"])
    assert_one_line_error(code, err, "--hybrid", "--device wasm")
    code, _, err = run_cli(["calibrate", dag, "--hybrid", "--device", "hybrid-sim", "--repeats", "0"])
    assert_one_line_error(code, err, "--repeats")
    code, _, err = run_cli(["calibrate", dag])
    assert_one_line_error(code, err, "--data")
    assert dag.read_bytes() == before


@pytest.mark.slow
def test_the_calibrated_crossover_is_recorded_and_the_next_load_places_by_it(tmp_path):
    case, cus, dag = _decomposed(tmp_path)
    assert run_cli(["compile-wasm", "--cu-dir", cus, "--dag", dag, "--output", tmp_path / "wasm-bin"])[0] == 0
    assert run_cli(["compile-cuda", "--cu-dir", cus, "--dag", dag, "--output", tmp_path / "cuda-bin",
                    "--compiler", "nvrtc", "--arch", "sm_90"])[0] == 0
    code, out, err = run_cli(["calibrate", dag, "--hybrid", "--device", "hybrid-sim", "--repeats", "2", "--json"])
    assert code == 0, err
    written = json.loads(dag.read_text())
    validate_dag(written)
    record = written["hybrid"]
    assert json.loads(out) == record and record["device"] == "cuda-sim" and record["repeats"] == 2
    flops = {cu["id"]: cu["flops"] for cu in written["cus"]}
    assert set(record["cus"]) == set(flops)          # every CU ran and has both builds: every CU timed
    for cu_id, timing in record["cus"].items():
        assert timing["flops"] == flops[cu_id] and timing["cpu_device"] == "wasm"
        assert timing["cpu_ms"] > 0 and timing["gpu_ms"] > 0
    points = [(t["flops"], t["gpu_ms"], t["cpu_ms"]) for t in record["cus"].values()]
    assert record["crossover_flops"] == crossover_threshold(points)

    x = RNG.standard_normal((32, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(case.path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    def run(device: str, env: dict | None = None) -> tuple[dict, dict]:
        out, trace = tmp_path / f"{device}.npz", tmp_path / f"{device}.json"
        code, _, err = run_cli(["run", dag, "--device", device, "--input", f"x={tmp_path / 'x.npy'}",
                                "--output", out, "--trace", trace], env=env)
        assert code == 0, err
        with np.load(out) as got:
            return dict(got), {e["cu"]: e["device"] for e in json.loads(trace.read_text())["cus"]}

    def expected(threshold):
        return {cu: "cuda-sim" if threshold is not None and f >= threshold else "wasm" for cu, f in flops.items()}

    single, _ = run("wasm")
    outputs, where = run("hybrid-sim")
    assert where == expected(record["crossover_flops"])
    assert where == {cu_id: t["placement"] for cu_id, t in record["cus"].items()}
    # cuda-sim loses to wasm on every CU, so the measured record keeps them all on the CPU; a record
    # that says otherwise (as a GPU's would) moves the heavy CUs over, and the variable beats both.
    written["hybrid"]["crossover_flops"] = threshold = max(flops.values())
    dag.write_text(json.dumps(written, indent=2))
    moved, where = run("hybrid-sim")
    assert where == expected(threshold) and "cuda-sim" in where.values() and "wasm" in where.values()
    _, where = run("hybrid-sim", env={THRESHOLD_VARIABLE: "0"})
    assert where == expected(0)
    for name, value in single.items():
        for got in (outputs, moved):
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5)

    written["hybrid"]["crossover_flops"] = "lots"
    dag.write_text(json.dumps(written, indent=2))
    code, _, err = run_cli(["run", dag, "--device", "hybrid-sim", "--example-inputs"])
    assert_one_line_error(code, err, str(dag), "hybrid.crossover_flops")
