"""The 16-bit integer GEMM's tile edges against onnxruntime, bit for bit: A packed with each row's
k pair broadcast (kernels/int8_pack_a.py, 8 k per packing step, the last k pairs one by one), tiles
of 4 rows x 8 columns, and M, N, K that are not multiples of any of them, K odd included; through
MatMulInteger alone and through dynamically quantized MiniLM's MatMulInteger -> Cast -> Mul(scale)
-> Add(bias) chain, which runs as the kernel's float epilogue."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh
from wasm_cases import make_model, run_onnxruntime, run_wasm

from backends.wasm.compile import compile_graph
from backends.wasm.kernels.int8_gemm import IntegerGemmOffsets, render_integer_gemm, scratch_bytes
from backends.wasm.options import parse_options
from ir.loops.contraction import IntegerGemmSpec
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline

# (m, k, n): rows past a group of 4, k past a packing step of 8 (odd and even tails, K < 8), columns
# past a panel of 8, one-row and one-column products, and MiniLM's 128 rows with one k over 384
EDGES = [(1, 1, 1), (3, 7, 9), (5, 9, 15), (6, 15, 17), (7, 17, 7), (2, 3, 8), (9, 31, 23), (13, 33, 1),
         (4, 8, 8), (1, 385, 12), (130, 385, 9)]
FEATURES = ["simd", "simd,relaxed-simd"]   # full-range weights keep the 16-bit kernel under relaxed SIMD


def _matmul_integer(rng, m, k, n, a_type, b_type):
    a_dtype, b_dtype = (np.uint8 if t == T.UINT8 else np.int8 for t in (a_type, b_type))
    b_info = np.iinfo(b_dtype)
    b = rng.integers(b_info.min, b_info.max + 1, (k, n)).astype(b_dtype)
    b[0, 0], b[-1, -1] = b_info.min, b_info.max   # the full range: never the 7-bit kernel
    initializers = [nh.from_array(b, "b"), nh.from_array(np.asarray(rng.integers(-3, 4), b_dtype), "b_zero")]
    nodes = [helper.make_node("MatMulInteger", ["a", "b", "a_zero", "b_zero"], ["acc"])]
    inputs = [helper.make_tensor_value_info("a", a_type, [m, k]), helper.make_tensor_value_info("a_zero", a_type, [])]
    a_info = np.iinfo(a_dtype)
    feeds = {"a": rng.integers(a_info.min, a_info.max + 1, (m, k)).astype(a_dtype),
             "a_zero": np.asarray(rng.integers(a_info.min, a_info.max + 1), a_dtype)}
    return nodes, inputs, initializers, feeds


@pytest.mark.parametrize("m, k, n", EDGES)
@pytest.mark.parametrize("a_type, b_type", [(T.UINT8, T.INT8), (T.INT8, T.UINT8)])
def test_matmul_integer_at_every_tile_edge_equals_onnxruntime(m, k, n, a_type, b_type):
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    nodes, inputs, initializers, feeds = _matmul_integer(rng, m, k, n, a_type, b_type)
    model = make_model(nodes, inputs, [helper.make_tensor_value_info("acc", T.INT32, None)], initializers, opset=13)
    want = run_onnxruntime(model, feeds)["acc"]
    for features in FEATURES:
        np.testing.assert_array_equal(run_wasm(model, feeds, features, "2")["acc"], want, err_msg=features)


def _dequantized_chain(rng, m, k, n):
    nodes, inputs, initializers, feeds = _matmul_integer(rng, m, k, n, T.UINT8, T.INT8)
    nodes += [helper.make_node("Cast", ["acc"], ["acc_f"], to=T.FLOAT),
              helper.make_node("Mul", ["acc_f", "scale"], ["scaled"]),
              helper.make_node("Add", ["scaled", "bias"], ["y"])]
    inputs.append(helper.make_tensor_value_info("scale", T.FLOAT, []))
    initializers.append(nh.from_array(rng.standard_normal(n).astype(np.float32), "bias"))
    feeds["scale"] = np.asarray(rng.uniform(1e-4, 1e-3), np.float32)
    model = make_model(nodes, inputs, [helper.make_tensor_value_info("y", T.FLOAT, None)], initializers, opset=13)
    return model, feeds


@pytest.mark.parametrize("m, k, n", EDGES)
def test_the_dequantising_epilogue_at_every_tile_edge_equals_onnxruntime(m, k, n):
    """quantize_dynamic's chain: the scale is a run-time scalar, the bias one value per column."""
    model, feeds = _dequantized_chain(np.random.default_rng(m * 104729 + k * 17 + n), m, k, n)
    want = run_onnxruntime(model, feeds)["y"]
    for features in FEATURES:
        np.testing.assert_array_equal(run_wasm(model, feeds, features, "2")["y"], want, err_msg=features)


def test_the_chain_runs_as_the_kernels_epilogue():
    model, _ = _dequantized_chain(np.random.default_rng(1), 9, 31, 23)
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    wat = compile_graph(graph, parse_options(None, "simd", "2")).wat
    assert "dequantised to float32" in wat and wat.count("i32x4.dot_i16x8_s") > 0


@pytest.mark.parametrize("m", [3, 8])
def test_the_16_bit_tile_reads_its_rows_without_shuffles(m):
    """Each row's k pair is packed already broadcast, so the k loop's only vector work is loads,
    dot products and adds (the shuffles are in the packing, once per product)."""
    spec = IntegerGemmSpec(m, 16, 20)
    packed_a, _, _ = scratch_bytes(spec)
    assert packed_a == 10 * 64   # one group at a time: 4 rows x 16 bytes per k pair
    wat = render_integer_gemm(spec, IntegerGemmOffsets(0, 4096, 8192, 16384, 16384 + packed_a, a_zero=32768))
    k_loops = wat[wat.index("(func $igemm_k"):]
    assert "i32x4.dot_i16x8_s" in k_loops and "shuffle" not in k_loops and "splat" not in k_loops
