"""Bad input never gives a traceback: one line on stderr naming the problem, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cli_helpers import assert_one_line_error, run_cli




def tiny_model(**overrides) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = overrides.get("nodes", [helper.make_node("Relu", ["x"], ["y"], name="relu")])
    graph = helper.make_graph(nodes, "tiny", [x], [y], overrides.get("initializers", []))
    return helper.make_model(graph, opset_imports=overrides.get("opsets", [helper.make_opsetid("", 17)]))


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def test_missing_file(tmp_path):
    code, _, err = run_cli(["inspect", str(tmp_path / "nope.onnx")])
    assert_one_line_error(code, err, "nope.onnx", "no such file")


def test_directory_instead_of_model(tmp_path):
    code, _, err = run_cli(["inspect", str(tmp_path)])
    assert_one_line_error(code, err, "is a directory")


def test_random_bytes(tmp_path):
    path = tmp_path / "random.onnx"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    code, _, err = run_cli(["inspect", str(path)])
    assert_one_line_error(code, err, "random.onnx", "not a valid ONNX model")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    code, _, err = run_cli(["inspect", str(path)])
    assert_one_line_error(code, err, "empty.onnx")


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.9])
def test_truncated_model(tmp_path, fraction):
    weights = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.arange(16, dtype=np.float32))
    model = tiny_model(nodes=[helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], initializers=[weights])
    data = model.SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: int(len(data) * fraction)])
    code, _, err = run_cli(["inspect", str(path)])
    assert_one_line_error(code, err)


def test_input_nothing_produces(tmp_path):
    model = tiny_model(nodes=[helper.make_node("Add", ["x", "ghost"], ["y"], name="add_ghost")])
    code, _, err = run_cli(["inspect", str(save(model, tmp_path / "m.onnx"))])
    assert_one_line_error(code, err, "add_ghost", "ghost")


def test_cycle(tmp_path):
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="first"),
             helper.make_node("Relu", ["a"], ["b"], name="second"),
             helper.make_node("Identity", ["b"], ["y"], name="out")]
    code, _, err = run_cli(["inspect", str(save(tiny_model(nodes=nodes), tmp_path / "m.onnx"))])
    assert_one_line_error(code, err, "cycle")


def test_unknown_op_domain(tmp_path):
    model = tiny_model(nodes=[helper.make_node("Frobnicate", ["x"], ["y"], name="frob", domain="com.example")],
                       opsets=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    code, _, err = run_cli(["inspect", str(save(model, tmp_path / "m.onnx"))])
    assert_one_line_error(code, err, "com.example")


def test_node_domain_not_imported(tmp_path):
    model = tiny_model(nodes=[helper.make_node("Relu", ["x"], ["y"], name="r", domain="com.microsoft")])
    code, _, err = run_cli(["inspect", str(save(model, tmp_path / "m.onnx"))])
    assert_one_line_error(code, err, "'r'", "com.microsoft")


@pytest.mark.parametrize("bad", ["x", "x=", "x=1x", "x=1xax3", "=1x2", "x=2.5x4", "x=-1x4"])
def test_bad_input_shape_string(tmp_path, bad):
    path = save(tiny_model(), tmp_path / "m.onnx")
    code, _, err = run_cli(["inspect", str(path), "--input-shape", bad])
    assert_one_line_error(code, err, "--input-shape")


def test_input_shape_for_unknown_input(tmp_path):
    path = save(tiny_model(), tmp_path / "m.onnx")
    code, _, err = run_cli(["inspect", str(path), "--input-shape", "nope=1x4"])
    assert_one_line_error(code, err, "'nope'", "inputs: x")


def test_input_shape_rank_mismatch(tmp_path):
    path = save(tiny_model(), tmp_path / "m.onnx")
    code, _, err = run_cli(["inspect", str(path), "--input-shape", "x=1x4x4"])
    assert_one_line_error(code, err, "rank 3")


def test_dim_that_matches_nothing(tmp_path):
    path = save(tiny_model(), tmp_path / "m.onnx")
    code, _, err = run_cli(["inspect", str(path), "--dim", "seq=4"])
    assert_one_line_error(code, err, "'seq'", "batch")


def test_unknown_option(tmp_path):
    code, _, err = run_cli(["inspect", "--bogus"])
    assert_one_line_error(code, err, "--bogus")


def test_inspect_reports_dynamic_dims_and_binding(tmp_path):
    path = save(tiny_model(), tmp_path / "m.onnx")
    code, out, err = run_cli(["inspect", str(path), "--json"])
    assert code == 0, err
    import json
    report = json.loads(out)
    assert report["source"]["dynamic_dims"] == ["batch"]
    assert report["source"]["op_counts"] == {"Relu": 1}
    code, out, err = run_cli(["inspect", str(path), "--dim", "batch=3", "--json"])
    report = json.loads(out)
    assert report["optimized"]["inputs"][0]["shape"] == [3, 4]
    assert report["optimized"]["outputs"][0]["shape"] == [3, 4]
    assert report["optimized"]["dynamic_dims"] == []


def test_real_entry_point_prints_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cortex.cli", "inspect", str(tmp_path / "missing.onnx")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.onnx'}: no such file"]


def _with_invalid_utf8(marker: str) -> bytes:
    """A model whose string `marker` (8 ASCII bytes somewhere in it) starts with bytes that are not UTF-8."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    pool = helper.make_node("MaxPool", ["x"], ["y"], name="NODENAME", doc_string="DOCSTRNG", kernel_shape=[2, 2],
                            auto_pad="SAME_UPP")
    model = helper.make_model(helper.make_graph([pool], "GRAPHNAM", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.metadata_props.add(key="METAKEY1", value="METAVAL1")
    data = model.SerializeToString()
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), b"\xff\xfe" + marker.encode()[2:])


@pytest.mark.parametrize("marker, place", [
    ("NODENAME", "graph.node[0](MaxPool).name"),
    ("DOCSTRNG", "graph.node[0](MaxPool).doc_string"),
    ("SAME_UPP", "graph.node[0](MaxPool).attribute[0](auto_pad).s"),
    ("GRAPHNAM", "graph.name"),
    ("METAKEY1", "metadata_props[0].key"),
    ("METAVAL1", "metadata_props[0].value"),
])
@pytest.mark.parametrize("command", ["inspect", "decompose"])
def test_strings_that_are_not_utf8_are_one_line(tmp_path, marker, place, command):
    path = tmp_path / "bad.onnx"
    path.write_bytes(_with_invalid_utf8(marker))
    argv = ["inspect", path] if command == "inspect" else ["decompose", "--model-path", path, "--output-dir",
                                                            tmp_path / "cus"]
    code, _, err = run_cli(argv)
    assert_one_line_error(code, err, "bad.onnx", place, "not valid UTF-8")
    assert not (tmp_path / "cus").exists()
