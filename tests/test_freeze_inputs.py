"""`cortex decompose --freeze-input NAME=FILE.npy`: a parameter input becomes a constant, the compiled
model no longer takes it, and its results match onnxruntime fed the same value."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from tests.test_cli_errors import assert_one_line_error, run_cli


def slice_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends"], ["y"])], "slice",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 8]),
         helper.make_tensor_value_info("starts", TensorProto.INT64, [2]),
         helper.make_tensor_value_info("ends", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def reduce_sum_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "reduce",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 5]),
         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def save_array(path: Path, array: np.ndarray) -> Path:
    np.save(path, array)
    return path


def compile_and_run(model: onnx.ModelProto, frozen: dict[str, np.ndarray], data: np.ndarray, tmp: Path) -> tuple[np.ndarray, dict]:
    onnx.save(model, tmp / "model.onnx")
    freeze = [arg for name, value in frozen.items()
              for arg in ("--freeze-input", f"{name}={save_array(tmp / f'{name}.npy', value)}")]
    for argv in (["decompose", "--model-path", str(tmp / "model.onnx"), "--output-dir", str(tmp / "cus"), *freeze],
                 ["build-dag", "--cu-dir", str(tmp / "cus"), "--output", str(tmp / "dag.json")],
                 ["compile-wasm", "--cu-dir", str(tmp / "cus"), "--output", str(tmp / "wasm"),
                  "--dag", str(tmp / "dag.json")],
                 ["run", str(tmp / "dag.json"), "--input", f"x={save_array(tmp / 'x.npy', data)}",
                  "--output", str(tmp / "out.npz")]):
        code, _, err = run_cli(argv)
        assert code == 0, f"{argv[0]}: {err}"
    manifest = json.loads((tmp / "cus" / "manifest.json").read_text())
    return np.load(tmp / "out.npz")["y"], manifest


def onnxruntime_result(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_frozen_slice_bounds_match_onnxruntime(tmp_path):
    x = np.arange(48, dtype=np.float32).reshape(6, 8)
    frozen = {"starts": np.array([1, 2], dtype=np.int64), "ends": np.array([5, 7], dtype=np.int64)}
    got, manifest = compile_and_run(slice_model(), frozen, x, tmp_path)
    want = onnxruntime_result(slice_model(), {"x": x, **frozen})
    np.testing.assert_array_equal(got, want)
    assert [i["name"] for i in manifest["inputs"]] == ["x"]


def test_frozen_reduce_axes_match_onnxruntime(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    frozen = {"axes": np.array([1], dtype=np.int64)}
    got, _ = compile_and_run(reduce_sum_model(), frozen, x, tmp_path)
    want = onnxruntime_result(reduce_sum_model(), {"x": x, **frozen})
    assert got.shape == want.shape == (3, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_manifest_and_dag_record_what_was_frozen(tmp_path):
    axes = np.array([2], dtype=np.int64)
    _, manifest = compile_and_run(reduce_sum_model(), {"axes": axes}, np.ones((3, 4, 5), np.float32), tmp_path)
    assert manifest["options"]["frozen_inputs"] == [
        {"name": "axes", "dtype": "int64", "shape": [1], "sha256": hashlib.sha256(axes.tobytes()).hexdigest()}]
    dag = json.loads((tmp_path / "dag.json").read_text())
    assert "axes" not in json.dumps(dag.get("inputs", []))


def test_an_npz_freezes_every_array_it_holds(tmp_path):
    onnx.save(slice_model(), tmp_path / "model.onnx")
    np.savez(tmp_path / "bounds.npz", starts=np.array([0, 0], np.int64), ends=np.array([2, 3], np.int64))
    code, _, err = run_cli(["decompose", "--model-path", str(tmp_path / "model.onnx"), "--output-dir",
                            str(tmp_path / "cus"), "--freeze-input", str(tmp_path / "bounds.npz")])
    assert code == 0, err
    manifest = json.loads((tmp_path / "cus" / "manifest.json").read_text())
    assert [f["name"] for f in manifest["options"]["frozen_inputs"]] == ["ends", "starts"]
    assert [i["name"] for i in manifest["inputs"]] == ["x"]


@pytest.mark.parametrize("name, value, fragments", [
    ("nope", np.array([1], np.int64), ["'nope'", "inputs: x, axes"]),
    ("axes", np.array([1], np.int32), ["axes", "int32", "int64"]),
    ("axes", np.array([1, 2], np.int64), ["axes", "[2]", "[1]"]),
    ("axes", np.array(1, np.int64), ["axes", "contradicts"]),
])
def test_a_value_that_contradicts_the_model_is_one_line(tmp_path, name, value, fragments):
    onnx.save(reduce_sum_model(), tmp_path / "model.onnx")
    path = save_array(tmp_path / "v.npy", value)
    code, _, err = run_cli(["decompose", "--model-path", str(tmp_path / "model.onnx"), "--output-dir",
                            str(tmp_path / "cus"), "--freeze-input", f"{name}={path}"])
    assert_one_line_error(code, err, "--freeze-input", *fragments)
    assert not (tmp_path / "cus").exists()


@pytest.mark.parametrize("content", [None, b"not an array"])
def test_an_unreadable_file_is_one_line(tmp_path, content):
    onnx.save(reduce_sum_model(), tmp_path / "model.onnx")
    path = tmp_path / "axes.npy"
    if content is not None:
        path.write_bytes(content)
    code, _, err = run_cli(["decompose", "--model-path", str(tmp_path / "model.onnx"), "--output-dir",
                            str(tmp_path / "cus"), "--freeze-input", f"axes={path}"])
    assert_one_line_error(code, err, "--freeze-input", "axes.npy")
