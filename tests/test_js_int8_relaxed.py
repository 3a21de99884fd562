"""The 8-bit integer GEMM under relaxed SIMD in the JavaScript runtime: weights whose columns span at
most 127 values (a reduce-range quantiser's) run on the relaxed dot product (kernels/int8_gemm.py),
whose result is the same on every engine for 7-bit second operands. The Python runtime (wasmtime)
gives onnxruntime's outputs (integers exactly), and Node must give the Python runtime's bit for bit:
the case js/test/models.test.js reads holds wasmtime's outputs at zero tolerance.

Node 20's V8 computes `i32x4.relaxed_dot_i8x16_i7x16_add_s` wrong in some code shapes (twice the
products, the accumulator dropped), so the kernel must not depend on it."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from js_cases import NODE, run_node_tests, write_case
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh
from wasm_cases import compile_pipeline, run_onnxruntime

import cortex
from backends.wasm.compile import compile_graph
from backends.wasm.options import parse_options
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

RELAXED = "simd,bulk-memory,relaxed-simd"
FLOAT_SHARE_OF_MAX = 1e-6     # float outputs: exact integer sums times the same scales, up to float rounding


def seven_bit_columns(rng, dtype, k: int, n: int) -> np.ndarray:
    """8-bit weights whose every column spans at most 127 values, at the type's extremes too."""
    info = np.iinfo(dtype)
    low = rng.integers(info.min, info.max - 126, n)
    low[:2] = info.min, info.max - 127
    return (low + rng.integers(0, 128, (k, n))).astype(dtype)


def int8_model(rng, m: int, k: int, n: int) -> tuple:
    """MatMulInteger (uint8 A, int8 B, per-column zero points: int32 out), QLinearMatMul (int8 A and
    B, per-column scales: int8 out) and DynamicQuantizeMatMul (float32 A quantized at run time,
    float32 out) on 7-bit weights, M, N and K no multiples of the tile's 4 rows, 8 columns and 4 k
    (partial tiles and the k tail run too); and a QLinearConv, whose kernel keeps 16-bit operands
    under relaxed SIMD."""
    initializers = [
        nh.from_array(seven_bit_columns(rng, np.int8, k, n), "b1"),
        nh.from_array(rng.integers(-128, 128, n).astype(np.int8), "b1_zero"),
        nh.from_array(seven_bit_columns(rng, np.int8, k, n), "b2"),
        nh.from_array(rng.uniform(0.002, 0.01, n).astype(np.float32), "b2_scale"),
        nh.from_array(np.zeros(n, np.int8), "b2_zero"), nh.from_array(np.float32(0.02 * k ** 0.5), "y_scale"),
        nh.from_array(np.int8(-3), "y_zero"),
        nh.from_array(seven_bit_columns(rng, np.int8, k, n), "b3"),
        nh.from_array(rng.uniform(0.002, 0.01, n).astype(np.float32), "b3_scale"),
        nh.from_array(rng.integers(-20, 20, n).astype(np.int8), "b3_zero"),
        nh.from_array(rng.standard_normal(n).astype(np.float32), "b3_bias"),
        nh.from_array(rng.integers(-128, 128, (8, 3, 3, 3)).astype(np.int8), "w"),
        nh.from_array(rng.uniform(0.002, 0.01, 8).astype(np.float32), "w_scale"),
        nh.from_array(np.zeros(8, np.int8), "w_zero"), nh.from_array(np.float32(0.05), "x_scale"),
        nh.from_array(np.uint8(120), "x_zero"), nh.from_array(np.float32(0.03), "c_scale"),
        nh.from_array(np.uint8(128), "c_zero"), nh.from_array(rng.integers(-500, 500, 8).astype(np.int32), "w_bias")]
    nodes = [helper.make_node("MatMulInteger", ["a1", "b1", "a1_zero", "b1_zero"], ["y1"]),
             helper.make_node("QLinearMatMul", ["a2", "a2_scale", "a2_zero", "b2", "b2_scale", "b2_zero", "y_scale",
                                                "y_zero"], ["y2"]),
             helper.make_node("DynamicQuantizeMatMul", ["a3", "b3", "b3_scale", "b3_zero", "b3_bias"], ["y3"],
                              domain="com.microsoft"),
             helper.make_node("QLinearConv", ["x", "x_scale", "x_zero", "w", "w_scale", "w_zero", "c_scale", "c_zero",
                                              "w_bias"], ["c"], pads=[1, 1, 1, 1])]
    inputs = [helper.make_tensor_value_info("a1", T.UINT8, [m, k]), helper.make_tensor_value_info("a1_zero", T.UINT8, []),
              helper.make_tensor_value_info("a2", T.INT8, [m, k]), helper.make_tensor_value_info("a2_scale", T.FLOAT, []),
              helper.make_tensor_value_info("a2_zero", T.INT8, []), helper.make_tensor_value_info("a3", T.FLOAT, [m, k]),
              helper.make_tensor_value_info("x", T.UINT8, [1, 3, 11, 13])]
    outputs = [helper.make_tensor_value_info("y1", T.INT32, [m, n]), helper.make_tensor_value_info("y2", T.INT8, [m, n]),
               helper.make_tensor_value_info("y3", T.FLOAT, [m, n]),
               helper.make_tensor_value_info("c", T.UINT8, [1, 8, 11, 13])]
    feeds = {"a1": rng.integers(0, 256, (m, k)).astype(np.uint8), "a1_zero": np.array(131, np.uint8),
             "a2": rng.integers(-128, 128, (m, k)).astype(np.int8), "a2_scale": np.array(0.02, np.float32),
             "a2_zero": np.array(5, np.int8), "a3": rng.standard_normal((m, k)).astype(np.float32),
             "x": rng.integers(0, 256, (1, 3, 11, 13)).astype(np.uint8)}
    feeds["a1"][0], feeds["a2"][0] = 255, -128        # the extremes of A against the extremes of B
    model = helper.make_model(helper.make_graph(nodes, "int8", inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model, feeds


def module_text(model: onnx.ModelProto, features: str) -> str:
    """The WAT of `model` compiled as one module."""
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return compile_graph(graph, parse_options(None, features, "2")).wat


def test_node_gives_wasmtimes_int8_results_under_relaxed_simd(tmp_path):
    model, feeds = int8_model(np.random.default_rng(7), 37, 203, 45)
    assert module_text(model, RELAXED).count("relaxed dot product") == 3, "the three GEMMs run the relaxed kernel"
    onnx.save(model, tmp_path / "model.onnx")
    dag = compile_pipeline(tmp_path / "model.onnx", tmp_path, RELAXED, min_cu_size=1, max_cu_depth=1)
    wasmtime = cortex.load(dag, device="wasm", policy="strict", threads=1).run(feeds)
    want = run_onnxruntime(model, feeds)
    for name, value in want.items():
        if value.dtype.kind == "f":
            bound = FLOAT_SHARE_OF_MAX * np.abs(value).max()
            np.testing.assert_allclose(wasmtime[name], value, rtol=0, atol=bound, err_msg=name)
        else:
            np.testing.assert_array_equal(wasmtime[name], value, err_msg=name)
    case = write_case(tmp_path, "int8-relaxed-simd", dag, [{"inputs": feeds, "outputs": wasmtime}], 0.0, 0.0)
    report = run_node_tests([case], tmp_path, "models.test.js")
    assert re.search(r"^ok \d+ - int8-relaxed-simd matches onnxruntime$", report, re.MULTILINE), report[-3000:]
