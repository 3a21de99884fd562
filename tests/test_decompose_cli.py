"""The `cortex decompose` / `cortex build-dag` command lines: user mistakes are one line and exit
code 2, a failed run leaves the output as it was, and the same input gives the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import run_cli
from cortex.tools.onnx_reference import run_dag
from testdata import SAMPLES_DIR, run_onnxruntime

CNN = SAMPLES_DIR / "cnn.onnx"


def cortex(*argv) -> tuple[int, str, str]:
    return run_cli(list(argv))


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_decompose_then_build_dag_writes_cus_manifest_and_dag(tmp_path):
    code, out, err = cortex("decompose", "--model-path", CNN, "--output-dir", tmp_path / "cus", "--json")
    assert code == 0, err
    summary = json.loads(out)
    manifest = json.loads((tmp_path / "cus" / "manifest.json").read_text())
    assert manifest["schema"] == "cortex.cus/1"
    assert summary["cus"] == len(manifest["cus"]) >= 1
    assert manifest["options"] == {"min_cu_size": 256, "max_cu_size": 1_000_000, "max_cu_depth": 3,
                                   "input_shapes": {}, "dims": {}}
    assert manifest["inputs"] == [{"name": "x", "dtype": "float32", "shape": [1, 3, 32, 32]}]
    for cu in manifest["cus"]:
        assert (tmp_path / "cus" / cu["path"]).is_file()
        assert set(cu) >= {"id", "path", "sha256", "nodes", "op_types", "fusion_groups", "params", "depth",
                           "inputs", "outputs"}
    code, out, err = cortex("build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "dag.json", "--json")
    assert code == 0, err
    dag = json.loads((tmp_path / "dag.json").read_text())
    assert dag["schema"] == "cortex.dag/1" and json.loads(out)["cus"] == len(dag["cus"])


def test_the_summary_table_names_the_limits_and_border_bytes(tmp_path):
    code, out, _ = cortex("decompose", "--model-path", CNN, "--output-dir", tmp_path / "cus", "--max-cu-depth", 1)
    assert code == 0
    for words in ("CUs", "params min / median / max", "max depth", "bytes crossing CU borders"):
        assert words in out
    assert "stayed under --min-cu-size: merging would exceed --max-cu-depth" in out


@pytest.mark.parametrize("argv, message", [
    (["--min-cu-size", "5000", "--max-cu-size", "100"], "--min-cu-size 5000 is larger than --max-cu-size 100"),
    (["--max-cu-depth", "0"], "--max-cu-depth must be at least 1"),
    (["--max-cu-size", "10", "--min-cu-size", "0"], "one output channel needs"),
    (["--input-shape", "nope=1x2"], "not an input of the model"),
])
def test_bad_options_are_one_line_errors_and_leave_the_output_as_it_was(argv, message, tmp_path):
    out_dir = tmp_path / "cus"
    assert cortex("decompose", "--model-path", CNN, "--output-dir", out_dir, "--json")[0] == 0
    before = tree(out_dir)
    code, _, err = cortex("decompose", "--model-path", CNN, "--output-dir", out_dir, *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1 and err.startswith("error: ")
    assert tree(out_dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cus"], "no temporary folders left behind"


def test_a_bad_model_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    code, _, err = cortex("decompose", "--model-path", bad, "--output-dir", tmp_path / "cus")
    assert code == 2 and str(bad) in err and err.count("\n") == 1
    assert not (tmp_path / "cus").exists()


def test_build_dag_refuses_a_folder_without_manifest(tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = cortex("build-dag", "--cu-dir", tmp_path / "empty", "--output", tmp_path / "dag.json")
    assert code == 2 and "manifest.json" in err and err.count("\n") == 1
    assert not (tmp_path / "dag.json").exists()


def test_build_dag_refuses_a_stale_manifest(tmp_path):
    cortex("decompose", "--model-path", CNN, "--output-dir", tmp_path / "cus", "--json")
    manifest = json.loads((tmp_path / "cus" / "manifest.json").read_text())
    cu_path = tmp_path / "cus" / manifest["cus"][0]["path"]
    model = onnx.load(cu_path)
    model.doc_string = "edited after decompose"
    cu_path.write_bytes(model.SerializeToString())
    code, _, err = cortex("build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "dag.json")
    assert code == 2 and "sha256 differs" in err and str(cu_path) in err


def test_build_dag_refuses_an_unknown_format(tmp_path):
    cortex("decompose", "--model-path", CNN, "--output-dir", tmp_path / "cus", "--json")
    code, _, err = cortex("build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "d", "--format", "xml")
    assert code == 2 and "--format 'xml'" in err


def test_decompose_is_deterministic(tmp_path):
    for name in ("a", "b"):
        cortex("decompose", "--model-path", CNN, "--output-dir", tmp_path / name / "cus", "--json")
        cortex("build-dag", "--cu-dir", tmp_path / name / "cus", "--output", tmp_path / name / "dag.json", "--json")
    assert tree(tmp_path / "a") == tree(tmp_path / "b")


def test_constant_outputs_and_inputs_passed_straight_through_still_work(tmp_path):
    c = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "c")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")], "edges",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("y", "c", "x")], [c])
    path = tmp_path / "edges.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert cortex("decompose", "--model-path", path, "--output-dir", tmp_path / "cus", "--json")[0] == 0
    assert cortex("build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "dag.json", "--json")[0] == 0
    feeds = {"x": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)}
    got, expected = run_dag(tmp_path / "dag.json", feeds), run_onnxruntime(path, feeds)
    for name in ("y", "c", "x"):
        np.testing.assert_array_equal(got[name], expected[name])


def test_the_installed_command_reports_errors_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cortex.cli", "build-dag", "--cu-dir", str(tmp_path / "none"),
                             "--output", str(tmp_path / "dag.json")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def test_a_folder_of_other_files_is_never_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = cortex("decompose", "--model-path", CNN, "--output-dir", tmp_path)
    assert code == 2 and "holds other files" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"
