"""The runtime loader: hash-checked artifacts, checked inputs, traps as errors, traces, a native-code
cache, and `cortex run` on .npy/.npz files with one-line errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

import cortex
from cli_helpers import assert_one_line_error, run_cli
from ir.errors import CortexError
from testdata import sample_model
from wasm_cases import compile_pipeline, make_model




@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    case = sample_model("cnn")
    out = tmp_path_factory.mktemp("cnn")
    return case, compile_pipeline(case.path, out, min_cu_size=64, max_cu_depth=3)


def test_run_matches_onnxruntime_and_returns_owned_arrays(cnn):
    case, dag_path = cnn
    model = cortex.load(dag_path, device="wasm")
    first = model.run(case.inputs)
    np.testing.assert_allclose(first["y"], case.outputs["y"], rtol=1e-4, atol=1e-5)
    kept = first["y"].copy()
    model.run({"x": np.zeros_like(case.inputs["x"])})   # a second run must not change the first result
    np.testing.assert_array_equal(first["y"], kept)


def test_native_code_is_cached_next_to_the_artifacts(cnn):
    _, dag_path = cnn
    cortex.load(dag_path)
    caches = sorted((dag_path.parent / "wasm-bin").glob("*.cwasm"))
    dag = json.loads(dag_path.read_text())
    assert len(caches) == len(dag["cus"])
    stamps = [c.stat().st_mtime_ns for c in caches]
    cortex.load(dag_path)                       # reuses the cache instead of rewriting it
    assert [c.stat().st_mtime_ns for c in caches] == stamps


def test_a_damaged_native_code_cache_is_recompiled_not_loaded(cnn):
    case, dag_path = cnn
    cortex.load(dag_path)
    for cache in (dag_path.parent / "wasm-bin").glob("*.cwasm"):
        cache.write_bytes(b"\0" * 64)
    got = cortex.load(dag_path).run(case.inputs)
    np.testing.assert_allclose(got["y"], case.outputs["y"], rtol=1e-4, atol=1e-5)
    assert all(c.stat().st_size > 64 for c in (dag_path.parent / "wasm-bin").glob("*.cwasm"))


def test_wrong_input_shape_dtype_or_name_is_a_clear_error(cnn):
    case, dag_path = cnn
    model = cortex.load(dag_path)
    x = case.inputs["x"]
    with pytest.raises(CortexError, match=r"input 'x' has shape \[1, 3, 16, 16\], the model expects \[1, 3, 32, 32\]"):
        model.run({"x": x[:, :, :16, :16]})
    with pytest.raises(CortexError, match="input 'x' has dtype float64, the model expects float32"):
        model.run({"x": x.astype(np.float64)})
    with pytest.raises(CortexError, match="missing input 'x'"):
        model.run({})
    with pytest.raises(CortexError, match="unknown input 'z'"):
        model.run({"x": x, "z": x})


def test_tampered_module_is_refused(tmp_path):
    case = sample_model("mlp")
    dag_path = compile_pipeline(case.path, tmp_path, input_shapes=case.input_shapes, dims=case.dims)
    dag = json.loads(dag_path.read_text())
    module = dag_path.parent / dag["cus"][0]["artifacts"]["wasm"]["path"]
    data = bytearray(module.read_bytes())
    data[-1] ^= 0xFF
    module.write_bytes(bytes(data))
    with pytest.raises(CortexError, match="sha256 differs"):
        cortex.load(dag_path)


def test_dag_without_wasm_artifacts_is_refused(tmp_path):
    case = sample_model("cnn")
    dag_path = compile_pipeline(case.path, tmp_path)
    dag = json.loads(dag_path.read_text())
    for cu in dag["cus"]:
        cu["artifacts"] = {}
    dag_path.write_text(json.dumps(dag))
    with pytest.raises(CortexError, match="no wasm artifact.*compile-wasm"):
        cortex.load(dag_path)


def test_a_trap_names_the_cu_and_its_ops(tmp_path):
    model = make_model([helper.make_node("Div", ["a", "b"], ["y"], name="divide")],
                       [helper.make_tensor_value_info("a", T.INT32, [4]), helper.make_tensor_value_info("b", T.INT32, [4])],
                       [helper.make_tensor_value_info("y", T.INT32, [4])])
    path = tmp_path / "div.onnx"
    onnx.save(model, path)
    dag_path = compile_pipeline(path, tmp_path / "out")
    loaded = cortex.load(dag_path)
    a = np.arange(4, dtype=np.int32)
    np.testing.assert_array_equal(loaded.run({"a": a, "b": np.full(4, 2, np.int32)})["y"], a // 2)
    with pytest.raises(CortexError, match=r"cu-0000 \(Div\) trapped: .*divide by zero"):
        loaded.run({"a": a, "b": np.zeros(4, np.int32)})


def test_trace_records_time_and_bytes_per_cu(cnn):
    case, dag_path = cnn
    model = cortex.load(dag_path)
    model.run(case.inputs)
    trace = model.trace_document()
    dag = json.loads(dag_path.read_text())
    assert [t["cu"] for t in trace["cus"]] == dag["order"]
    for t, event in zip(trace["cus"], trace["traceEvents"]):
        assert t["seconds"] > 0 and t["bytes_in"] > 0 and t["bytes_out"] > 0
        assert event["ph"] == "X" and event["name"] == t["cu"]


def test_cli_run_writes_outputs_and_trace(cnn, tmp_path):
    case, dag_path = cnn
    np.save(tmp_path / "x.npy", case.inputs["x"])
    code, out, err = run_cli(["run", str(dag_path), "--input", f"x={tmp_path / 'x.npy'}", "--output",
                              str(tmp_path / "y.npz"), "--trace", str(tmp_path / "t.json")])
    assert code == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["y"], case.outputs["y"], rtol=1e-4, atol=1e-5)
    assert json.loads((tmp_path / "t.json").read_text())["device"] == "wasm"
    np.savez(tmp_path / "inputs.npz", x=case.inputs["x"])
    code, _, err = run_cli(["run", str(dag_path), "--input", str(tmp_path / "inputs.npz"), "--output",
                            str(tmp_path / "y2.npz")])
    assert code == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "y2.npz")["y"], np.load(tmp_path / "y.npz")["y"])


def test_cli_run_errors_are_one_line(cnn, tmp_path):
    case, dag_path = cnn
    np.save(tmp_path / "bad.npy", case.inputs["x"][0])
    code, _, err = run_cli(["run", str(dag_path), "--input", f"x={tmp_path / 'bad.npy'}"])
    assert_one_line_error(code, err, "input 'x' has shape [3, 32, 32]")
    code, _, err = run_cli(["run", str(dag_path), "--input", f"x={tmp_path / 'missing.npy'}"])
    assert_one_line_error(code, err, "does not exist")
    code, _, err = run_cli(["run", str(dag_path), "--device", "tpu", "--example-inputs"])
    assert_one_line_error(code, err, "unknown device 'tpu'")
    code, _, err = run_cli(["run", str(tmp_path / "nope.json")])
    assert_one_line_error(code, err, "nope.json", "no such file")
