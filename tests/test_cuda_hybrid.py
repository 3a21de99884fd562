"""`--device hybrid`: CUs placed on wasm or on the GPU by their flops, with cuda-sim standing in for
the GPU (`hybrid-sim`). The outputs equal the single-device runs, the trace says where each CU ran
and what crossed the border, and a bad threshold is one line."""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnxruntime as ort
import pytest
from cli_helpers import assert_one_line_error, run_cli
from testdata import sample_model

from backends.hybrid import DEFAULT_GPU_MIN_FLOPS, THRESHOLD_VARIABLE, placer

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
