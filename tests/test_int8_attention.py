"""The WebAssembly integer GEMM with B an activation (attention's Q @ K^T and scores @ V in QDQ and
QOperator transformers: QLinearMatMul / MatMulInteger over a batch of heads, B packed at run time
less its zero point), and the dequantising epilogue of MatMulIntegerToFloat (MatMulInteger -> Cast
-> Mul(scale) -> Add(bias) [-> Add(residual)] in one kernel). Integer results are bit-exact against
onnxruntime and the loop nest; the float epilogue rounds float(acc) * scale, then + bias, then +
residual, each to float32 (no fused multiply-add), exactly as the unfused loop nests do."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh
from wasm_cases import make_model, run_onnxruntime, run_wasm

from backends.wasm.compile import compile_graph
from backends.wasm.options import parse_options
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline

ONNX_TYPE = {np.uint8: T.UINT8, np.int8: T.INT8}
# (batch dims, m, k, n): heads, tile edges (4 rows, 8 columns, k pairs), odd sizes, one row
BATCHED = [((1, 12), 16, 32, 16), ((2, 3), 5, 7, 9), ((4,), 1, 1, 1), ((1, 2), 9, 33, 17), ((3,), 8, 16, 8),
           ((2, 2), 13, 2, 23)]


def _ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _zero(rng, dtype):
    info = np.iinfo(dtype)
    return np.asarray((int(info.min) + int(info.max) + 1) // 2 + rng.integers(-30, 31), dtype)


def _wat(model, features="simd"):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return compile_graph(graph, parse_options(None, features, "2")).wat


def _qlinear_attention_model(rng, batch, m, k, n, a_dtype, b_dtype, out_dtype, zeros_as_inputs):
    """y = QLinearMatMul(a, b) with both operands inputs; the zero points inputs or initializers."""
    a_shape, b_shape = (*batch, m, k), (*batch, k, n)
    feeds = {"a": _ints(rng, a_dtype, a_shape), "b": _ints(rng, b_dtype, b_shape)}
    scalars = {"a_scale": np.float32(rng.uniform(0.01, 0.03)), "a_zero": _zero(rng, a_dtype),
               "b_scale": np.float32(rng.uniform(0.01, 0.03)), "b_zero": _zero(rng, b_dtype),
               "y_scale": np.float32(0.0004 * 255 * k ** 0.5), "y_zero": _zero(rng, out_dtype)}
    inputs = [helper.make_tensor_value_info("a", ONNX_TYPE[a_dtype], a_shape),
              helper.make_tensor_value_info("b", ONNX_TYPE[b_dtype], b_shape)]
    initializers = []
    for name, value in scalars.items():
        if zeros_as_inputs and name.endswith("zero"):
            inputs.append(helper.make_tensor_value_info(name, ONNX_TYPE[value.dtype.type], ()))
            feeds[name] = value
        else:
            initializers.append(nh.from_array(np.asarray(value), name))
    node = helper.make_node("QLinearMatMul", ["a", "a_scale", "a_zero", "b", "b_scale", "b_zero", "y_scale", "y_zero"],
                            ["y"])
    model = make_model([node], inputs, [helper.make_tensor_value_info("y", ONNX_TYPE[out_dtype], None)],
                       initializers, opset=13)
    return model, feeds


@pytest.mark.parametrize("batch, m, k, n", BATCHED)
@pytest.mark.parametrize("a_dtype, b_dtype, out_dtype, zeros_as_inputs", [
    (np.int8, np.int8, np.int8, False), (np.uint8, np.int8, np.uint8, True), (np.uint8, np.uint8, np.uint8, True),
    (np.int8, np.int8, np.int8, True)])
def test_batched_qlinear_matmul_of_two_activations_equals_onnxruntime_and_the_loop_nest(
        batch, m, k, n, a_dtype, b_dtype, out_dtype, zeros_as_inputs):
    rng = np.random.default_rng(m * 100 + n * 10 + k + len(batch))
    model, feeds = _qlinear_attention_model(rng, batch, m, k, n, a_dtype, b_dtype, out_dtype, zeros_as_inputs)
    want = run_onnxruntime(model, feeds)["y"]
    assert len(np.unique(want)) > min(2, want.size - 1)
    got = run_wasm(model, feeds, "simd", "2")["y"]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, run_wasm(model, feeds, "", "2")["y"])   # the loop nest


@pytest.mark.parametrize("a_shape, b_shape", [((2, 3, 5, 7), (2, 3, 7, 9)), ((1, 12, 16, 32), (1, 12, 32, 16)),
                                              ((3, 6, 10), (10, 11)), ((7,), (7, 5))])
@pytest.mark.parametrize("a_dtype, b_dtype", [(np.uint8, np.int8), (np.int8, np.uint8), (np.uint8, np.uint8)])
def test_matmul_integer_of_two_activations_equals_onnxruntime_and_the_loop_nest(a_shape, b_shape, a_dtype, b_dtype):
    rng = np.random.default_rng(sum(a_shape) + 7 * sum(b_shape))
    feeds = {"a": _ints(rng, a_dtype, a_shape), "b": _ints(rng, b_dtype, b_shape),
             "a_zero": _zero(rng, a_dtype), "b_zero": _zero(rng, b_dtype)}
    inputs = [helper.make_tensor_value_info(name, ONNX_TYPE[value.dtype.type], value.shape)
              for name, value in feeds.items()]
    model = make_model([helper.make_node("MatMulInteger", ["a", "b", "a_zero", "b_zero"], ["y"])], inputs,
                       [helper.make_tensor_value_info("y", T.INT32, None)], opset=13)
    want = run_onnxruntime(model, feeds)["y"]
    exact = (feeds["a"].astype(np.int64) - int(feeds["a_zero"])) @ (feeds["b"].astype(np.int64) - int(feeds["b_zero"]))
    np.testing.assert_array_equal(want, exact)
    got = run_wasm(model, feeds, "simd", "2")["y"]
    assert got.dtype == np.int32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, run_wasm(model, feeds, "simd", "0")["y"])   # the loop nest


def test_attention_products_run_on_the_dot_product_kernel():
    rng = np.random.default_rng(1)
    model, _ = _qlinear_attention_model(rng, (1, 12), 16, 32, 16, np.int8, np.int8, np.int8, False)
    wat = _wat(model)
    assert "x 12, A int8, B packed at run time, requantised to int8" in wat and "i32x4.dot_i16x8_s" in wat


# -- the dequantising epilogue ------------------------------------------------------------------

def _dynamic_product_model(rng, rows, k, n, per_column, bias, residual, b_dtype=np.int8):
    """quantize_dynamic's form: DynamicQuantizeLinear(x) -> MatMulInteger(w) -> Cast -> Mul(x_scale *
    w_scale) [-> Add(bias)] [-> Add(residual)], the scalar Mul listed after the product as the
    quantizer writes it."""
    w = _ints(rng, b_dtype, (k, n))
    per = (n,) if per_column else ()
    initializers = [nh.from_array(w, "w"), nh.from_array(_zero(rng, b_dtype) + np.zeros(per, b_dtype), "w_zero"),
                    nh.from_array(rng.uniform(0.002, 0.01, per).astype(np.float32), "w_scale")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "x_scale", "x_zero"]),
             helper.make_node("MatMulInteger", ["xq", "w", "x_zero", "w_zero"], ["acc"]),
             helper.make_node("Mul", ["x_scale", "w_scale"], ["scale"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=T.FLOAT),
             helper.make_node("Mul", ["accf", "scale"], ["scaled" if bias or residual else "y"])]
    inputs = [helper.make_tensor_value_info("x", T.FLOAT, (*rows, k))]
    feeds = {"x": rng.standard_normal((*rows, k)).astype(np.float32)}
    last = "scaled"
    if bias:
        initializers.append(nh.from_array(rng.standard_normal(n).astype(np.float32), "bias"))
        nodes.append(helper.make_node("Add", ["bias", last], ["biased" if residual else "y"]))
        last = "biased"
    if residual:
        inputs.append(helper.make_tensor_value_info("r", T.FLOAT, (*rows, n)))
        feeds["r"] = rng.standard_normal((*rows, n)).astype(np.float32)
        nodes.append(helper.make_node("Add", [last, "r"], ["y"]))
    model = make_model(nodes, inputs, [helper.make_tensor_value_info("y", T.FLOAT, None)], initializers, opset=13)
    return model, feeds


def _unfused(model, feeds):
    """The same graph with every node its own loop nest (no kernels at opt-level 0)."""
    return run_wasm(model, feeds, "simd", "0")["y"]


@pytest.mark.parametrize("rows, k, n", [((1, 16), 32, 24), ((5,), 7, 9), ((2, 3), 33, 17), ((1,), 1, 1),
                                        ((1, 128), 384, 64)])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("bias, residual", [(True, False), (False, False), (True, True), (False, True)])
def test_the_fused_epilogue_equals_the_unfused_float32_math(rows, k, n, per_column, bias, residual):
    rng = np.random.default_rng(k * 10 + n + per_column)
    model, feeds = _dynamic_product_model(rng, rows, k, n, per_column, bias, residual)
    wat = _wat(model)
    assert "dequantised to float32" in wat
    got = run_wasm(model, feeds, "simd", "2")["y"]
    want = _unfused(model, feeds)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    # onnxruntime runs the same standard ops: the same float32 roundings
    np.testing.assert_array_equal(got, run_onnxruntime(model, feeds)["y"])


def _contrib_model(op, rng, rows, k, n, per_column, b_dtype=np.int8):
    w = _ints(rng, b_dtype, (k, n))
    per = (n,) if per_column else ()
    initializers = [nh.from_array(w, "w"), nh.from_array(rng.uniform(0.002, 0.01, per).astype(np.float32), "w_scale"),
                    nh.from_array(_zero(rng, b_dtype) + np.zeros(per, b_dtype), "w_zero"),
                    nh.from_array(rng.standard_normal(n).astype(np.float32), "bias")]
    if op == "DynamicQuantizeMatMul":
        node = helper.make_node(op, ["x", "w", "w_scale", "w_zero", "bias"], ["y"], domain="com.microsoft")
        inputs = [helper.make_tensor_value_info("x", T.FLOAT, (*rows, k))]
        feeds = {"x": rng.standard_normal((*rows, k)).astype(np.float32)}
    else:
        node = helper.make_node(op, ["x", "w", "x_scale", "w_scale", "x_zero", "w_zero", "bias"], ["y"],
                                domain="com.microsoft")
        inputs = [helper.make_tensor_value_info("x", T.UINT8, (*rows, k)),
                  helper.make_tensor_value_info("x_scale", T.FLOAT, ()),
                  helper.make_tensor_value_info("x_zero", T.UINT8, ())]
        feeds = {"x": _ints(rng, np.uint8, (*rows, k)), "x_scale": np.array(0.02, np.float32), "x_zero": np.array(131, np.uint8)}
    model = make_model([node], inputs, [helper.make_tensor_value_info("y", T.FLOAT, None)], initializers, opset=17)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model, feeds


@pytest.mark.parametrize("op", ["DynamicQuantizeMatMul", "MatMulIntegerToFloat"])
@pytest.mark.parametrize("rows, k, n, per_column", [((1, 16), 32, 24, False), ((5,), 7, 9, True), ((2, 3), 33, 17, True)])
def test_contrib_integer_products_run_fused_and_match_onnxruntime(op, rows, k, n, per_column):
    rng = np.random.default_rng(k + n)
    model, feeds = _contrib_model(op, rng, rows, k, n, per_column)
    assert "dequantised to float32" in _wat(model)
    got = run_wasm(model, feeds, "simd", "2")["y"]
    np.testing.assert_array_equal(got, _unfused(model, feeds))
    want = run_onnxruntime(model, feeds)["y"]
    # onnxruntime's kernel may round the scale-and-bias step differently (a fused multiply-add):
    # at most an ulp or two of the result
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
