"""`cortex verify` compares a compiled model with onnxruntime and fails on a mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run_cli
from cortex.commands.verify import compare

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def test_compiled_sample_verifies_against_onnxruntime(tmp_path):
    model = SAMPLES / "mlp.onnx"
    assert run_cli(["decompose", "--model-path", str(model), "--output-dir", str(tmp_path / "cus"), "--dim", "batch=2",
                "--json"])[0] == 0
    assert run_cli(["build-dag", "--cu-dir", str(tmp_path / "cus"), "--output", str(tmp_path / "dag.json"), "--json"])[0] == 0
    assert run_cli(["compile-wasm", "--cu-dir", str(tmp_path / "cus"), "--dag", str(tmp_path / "dag.json"),
                "--output", str(tmp_path / "wasm"), "--json"])[0] == 0
    code, out, err = run_cli(["verify", str(tmp_path / "dag.json"), "--model", str(model), "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and report["outputs"] and all(o["max_abs_error"] < 1e-4 for o in report["outputs"])
    code, _, err = run_cli(["verify", str(tmp_path / "dag.json"), "--model", str(SAMPLES / "cnn.onnx")])
    assert code == 2 and "not the model this dag.json was built from" in err


def test_compare_flags_values_outside_tolerance():
    ref = np.array([1.0, 2.0, 3.0], np.float32)
    assert compare("y", ref.copy(), ref, 1e-4, 1e-5)["ok"]
    bad = compare("y", ref + np.array([0, 0, 1e-2], np.float32), ref, 1e-4, 1e-5)
    assert not bad["ok"] and bad["max_abs_error"] == pytest.approx(1e-2, rel=1e-3)
    assert not compare("y", ref[:2], ref, 1e-4, 1e-5)["ok"]
    nan = np.array([np.nan], np.float32)
    assert compare("y", nan, nan.copy(), 1e-4, 1e-5)["ok"]
    # a masked score: the same infinity on both sides is no error, a different one is
    masked = np.array([-np.inf, 0.5, np.inf], np.float32)
    same = compare("y", masked.copy(), masked, 1e-4, 1e-5)
    assert same["ok"] and same["max_abs_error"] == 0.0
    flipped = compare("y", -masked, masked, 1e-4, 1e-5)
    assert not flipped["ok"] and flipped["max_abs_error"] == np.inf
