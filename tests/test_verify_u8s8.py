"""`cortex verify` judges uint8 x int8 products against exact ones on every CPU: where onnxruntime
saturates their pair sums at 16 bits (x86 without VNNI), its reference runs the model rewritten by
`cortex.tools.exact_u8s8`, and says so; so do `--bisect`'s per-CU references."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from backends.onnxruntime.device import OnnxruntimeDevice
from cli_helpers import run_cli
from cortex.commands import verify
from cortex.runtime import load
from cortex.tools import exact_u8s8
from cortex.tools.bisect import Bisection
from cortex.tools.exact_u8s8 import onnxruntime_saturates_u8s8

K, N = 64, 8


def _u8s8_model(path):
    """MatMulInteger of a uint8 input by int8 weights at the extremes: every pair of products is
    255 * 127 + 255 * 127, past int16."""
    rng = np.random.default_rng(0)
    b = np.where(rng.random((K, N)) < 0.9, 127, -128).astype(np.int8)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b", "a_zero", "b_zero"], ["y"], name="mmi")], "u8s8",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [2, N])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.array(0, np.uint8), "a_zero"),
         numpy_helper.from_array(np.array(-1, np.int8), "b_zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return b


def test_the_reference_of_a_u8s8_product_is_exact_whatever_the_cpu(tmp_path, monkeypatch):
    path = tmp_path / "u8s8.onnx"
    b = _u8s8_model(path)
    a = np.full((2, K), 255, np.uint8)
    exact = a.astype(np.int64) @ (b.astype(np.int64) + 1)
    # forced: the rewrite's reference, as a CPU without VNNI runs it
    monkeypatch.setattr(exact_u8s8, "onnxruntime_saturates_u8s8", lambda: True)
    got, rewritten = verify._run_onnxruntime(path, {"a": a}, ["y"])
    assert rewritten and np.array_equal(got["y"], exact)
    monkeypatch.setattr(exact_u8s8, "onnxruntime_saturates_u8s8", lambda: False)
    got, rewritten = verify._run_onnxruntime(path, {"a": a}, ["y"])
    assert not rewritten
    assert np.array_equal(got["y"], exact) != onnxruntime_saturates_u8s8()


def test_verify_passes_an_exact_u8s8_model_and_says_when_the_reference_was_rewritten(tmp_path):
    path = tmp_path / "u8s8.onnx"
    _u8s8_model(path)
    np.save(tmp_path / "a.npy", np.full((2, K), 255, np.uint8))
    for argv in (["decompose", "--model-path", str(path), "--output-dir", str(tmp_path / "cus")],
                 ["build-dag", "--cu-dir", str(tmp_path / "cus"), "--output", str(tmp_path / "dag.json")],
                 ["compile-wasm", "--cu-dir", str(tmp_path / "cus"), "--dag", str(tmp_path / "dag.json"),
                  "--output", str(tmp_path / "wasm")]):
        code, _, err = run_cli([*argv, "--json"])
        assert code == 0, err
    code, out, err = run_cli(["verify", str(tmp_path / "dag.json"), "--model", str(path),
                              "--input", f"a={tmp_path / 'a.npy'}", "--rtol", "0", "--atol", "0", "--json"])
    assert code == 0, out + err
    report = json.loads(out)
    assert report["ok"] and report["outputs"][0]["max_abs_error"] == 0
    assert ("reference_note" in report) == onnxruntime_saturates_u8s8()


def _saturating_matmul_integer(a, b, b_zero):
    """MatMulInteger as pmaddubsw computes it: each pair of raw products summed at int16 with
    saturation, then the zero point's correction."""
    a, b = a.astype(np.int64), b.astype(np.int64)
    pairs = a[:, 0::2, None] * b[None, 0::2] + a[:, 1::2, None] * b[None, 1::2]
    return np.clip(pairs, -32768, 32767).sum(axis=1) - b_zero * a.sum(axis=1, keepdims=True)


def test_bisect_judges_each_u8s8_cu_against_exact_products_where_onnxruntime_saturates(tmp_path, monkeypatch):
    """`verify --bisect`'s per-CU reference gets the same rewrite as verify's whole-model one: with
    the probe forced and onnxruntime's plain session made to saturate as pmaddubsw does, the CU that
    computes exact products is not named."""
    path = tmp_path / "u8s8.onnx"
    b = _u8s8_model(path)
    a = np.full((2, K), 255, np.uint8)
    exact = a.astype(np.int64) @ (b.astype(np.int64) + 1)
    saturated = _saturating_matmul_integer(a, b, -1)
    assert not np.array_equal(saturated, exact)
    for argv in (["decompose", "--model-path", str(path), "--output-dir", str(tmp_path / "cus")],
                 ["build-dag", "--cu-dir", str(tmp_path / "cus"), "--output", str(tmp_path / "dag.json")],
                 ["compile-wasm", "--cu-dir", str(tmp_path / "cus"), "--dag", str(tmp_path / "dag.json"),
                  "--output", str(tmp_path / "wasm")]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    monkeypatch.setattr(exact_u8s8, "onnxruntime_saturates_u8s8", lambda: True)
    monkeypatch.setattr(OnnxruntimeDevice, "run", lambda self, cu, inputs: {"y": _saturating_matmul_integer(
        inputs["a"], b, -1).astype(np.int32)})
    compiled = load(tmp_path / "dag.json", "wasm", threads=1)
    bisection = Bisection(compiled, 0.0, 0.0)
    assert np.array_equal(compiled.run({"a": a})["y"], exact)
    report = bisection.report(True)
    [check] = report.checks
    assert check.exact_u8s8 and check.ok and check.outputs[0]["max_abs_error"] == 0, check
    assert report.first_divergent is None and report.to_json()["cus"][0]["exact_u8s8"]
    # without the forced probe the plain (here saturating) session is the reference: the CU is named
    monkeypatch.setattr(exact_u8s8, "onnxruntime_saturates_u8s8", lambda: False)
    compiled = load(tmp_path / "dag.json", "wasm", threads=1)
    bisection = Bisection(compiled, 0.0, 0.0)
    compiled.run({"a": a})
    report = bisection.report(False)
    assert report.first_divergent is not None and not report.checks[0].exact_u8s8
