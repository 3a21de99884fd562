"""`cortex run --policy / --output-names / --trust-threshold / --trace`, through the installed
script."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run_cli
from cortex.runtime.trace import validate_trace
from runtime_cases import build, two_output_model
from testdata import run_onnxruntime


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    dag_path = build(two_output_model(), tmp_path_factory.mktemp("two_outputs"))
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    np.save(dag_path.parent / "x.npy", x)
    return dag_path, {"x": x}


def test_strict_with_output_names_runs_every_cu_and_writes_only_those_outputs(built, tmp_path):
    dag_path, feeds = built
    code, out, err = run_cli(["run", dag_path, "--input", f"x={dag_path.parent / 'x.npy'}", "--policy", "strict",
                              "--output-names", "y1", "--output", tmp_path / "o.npz", "--trace", tmp_path / "t.json",
                              "--json"])
    assert code == 0, err
    summary = json.loads(out)
    assert summary["policy"] == "strict" and list(summary["outputs"]) == ["y1"] and summary["skipped_cus"] == {}
    written = np.load(tmp_path / "o.npz")
    assert written.files == ["y1"]
    np.testing.assert_allclose(written["y1"], run_onnxruntime(dag_path.parent / "two_outputs.onnx", feeds)["y1"],
                               rtol=1e-5, atol=1e-6)
    trace = json.loads((tmp_path / "t.json").read_text())
    validate_trace(trace)
    dag = json.loads(dag_path.read_text())
    assert trace["policy"] == "strict" and trace["activated_cus"] == dag["order"]
    assert not list(tmp_path.glob(".t.json.*"))        # written atomically: no temporary file left


def test_output_names_skip_the_cus_they_do_not_need(built, tmp_path):
    dag_path, _ = built
    code, out, err = run_cli(["run", dag_path, "--input", f"x={dag_path.parent / 'x.npy'}", "--output-names", "y1",
                              "--trace", tmp_path / "t.json"])
    assert code == 0, err
    dag = json.loads(dag_path.read_text())
    only_y2 = next(cu["id"] for cu in dag["cus"] if cu["outputs"] == ["y2"])
    trace = json.loads((tmp_path / "t.json").read_text())
    assert trace["policy"] == "balanced" and trace["skipped_cus"] == [{"cu": only_y2, "reason": "not needed"}]
    assert "skipped: 1 not needed" in out


def test_offline_runs_the_source_model(built, tmp_path):
    dag_path, feeds = built
    code, out, err = run_cli(["run", dag_path, "--input", f"x={dag_path.parent / 'x.npy'}", "--policy", "offline",
                              "--output", tmp_path / "o.npz", "--trace", tmp_path / "t.json"])
    assert code == 0, err
    assert "offline: the source model two_outputs.onnx on onnxruntime" in out
    want = run_onnxruntime(dag_path.parent / "two_outputs.onnx", feeds, optimize=True)
    got = np.load(tmp_path / "o.npz")
    for name in ("y1", "y2"):
        np.testing.assert_array_equal(got[name], want[name])
    trace = json.loads((tmp_path / "t.json").read_text())
    validate_trace(trace)
    assert trace["offline"]["runtime"] == "onnxruntime" and trace["activated_cus"] == []


@pytest.mark.parametrize("flags, fragments", [
    (["--policy", "fastest"], ["--policy: unknown policy 'fastest'", "strict, balanced, aggressive, offline"]),
    (["--output-names", "y1,z"], ["--output-names: unknown output 'z'", "'y1', 'y2'"]),
    (["--output-names", "y1,"], ["--output-names 'y1,'"]),
    (["--trust-threshold", "1.5"], ["--trust-threshold must be in [0, 1]"]),
    (["--cache-bytes", "-1"], ["--cache-bytes cannot be negative"]),
])
def test_bad_run_flags_are_one_line_errors(built, flags, fragments):
    dag_path, _ = built
    code, _, err = run_cli(["run", dag_path, "--input", f"x={dag_path.parent / 'x.npy'}", *flags])
    assert_one_line_error(code, err, *fragments)
