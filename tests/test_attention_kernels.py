"""The float kernels around attention on WebAssembly against onnxruntime at their edges: Softmax with
-inf and float32-min masks and odd row lengths (vector part plus scalar tail), exp and erf at large,
tiny and special values, and DynamicQuantizeLinear bit-exact at odd sizes. Every case runs on plain
SIMD128 (exp's integer from 1.5 * 2^23 rounding), relaxed SIMD (relaxed truncation) and the scalar
loops. An erf GELU diamond that no kernel absorbs runs as one loop."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper
from wasm_cases import make_model, run_onnxruntime, run_wasm

from backends.wasm.compile import compile_graph
from backends.wasm.options import parse_options
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline

CONFIGS = (("simd", "3"), ("simd,relaxed-simd", "3"), ("", "0"))
RNG = np.random.default_rng(23)
SPECIAL = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-30, -1e-30, 1e-45, 3.4e38, -3.4e38]


def _unary_model(op: str, shape):
    return make_model([helper.make_node(op, ["x"], ["y"])], [helper.make_tensor_value_info("x", T.FLOAT, list(shape))],
                      [helper.make_tensor_value_info("y", T.FLOAT, list(shape))])


def _masked_softmax_model(shape):
    mask_shape = [1] * (len(shape) - 1) + [shape[-1]]
    return make_model([helper.make_node("Add", ["s", "mask"], ["m"]), helper.make_node("Softmax", ["m"], ["y"], axis=-1)],
                      [helper.make_tensor_value_info("s", T.FLOAT, list(shape)),
                       helper.make_tensor_value_info("mask", T.FLOAT, mask_shape)],
                      [helper.make_tensor_value_info("y", T.FLOAT, list(shape))])


def _assert_close(model, feeds, rtol, atol):
    want = run_onnxruntime(model, feeds)
    for features, level in CONFIGS:
        got = run_wasm(model, feeds, features, level)
        for name, expected in want.items():
            np.testing.assert_allclose(got[name], expected, rtol=rtol, atol=atol, equal_nan=True,
                                       err_msg=f"{name}, features={features!r}, opt-level {level}")


@pytest.mark.parametrize("length", [1, 3, 7, 16, 129])
@pytest.mark.parametrize("fill", [-np.inf, float(np.finfo(np.float32).min)])
def test_masked_softmax_equals_onnxruntime(length, fill):
    scores = (4 * RNG.standard_normal((3, 5, length))).astype(np.float32)
    mask = np.zeros((1, 1, length), np.float32)
    mask[..., length // 2 + 1:] = fill           # every row keeps at least one unmasked entry
    _assert_close(_masked_softmax_model(scores.shape), {"s": scores, "mask": mask}, rtol=1e-5, atol=1e-7)


def test_softmax_of_huge_and_tiny_scores_equals_onnxruntime():
    rows = np.array([[1e30, -1e30, 0.0, 1e30, 5.0, -5.0, 88.0, -104.0, 3.0],
                     [1e-30, -1e-30, 0.0, 1e-38, 1e-45, -1e-45, 2e-30, 0.0, 1e-20],
                     [100.0, 0.0, -100.0, 200.0, -200.0, 89.0, 90.0, -88.0, 0.5]], np.float32)
    _assert_close(_masked_softmax_model(rows.shape), {"s": rows, "mask": np.zeros((1, 9), np.float32)},
                  rtol=1e-5, atol=1e-7)


def test_exp_at_its_range_edges_equals_onnxruntime():
    """Around overflow (88.72), the last normal (-87.34), into subnormals and to zero (-103.97),
    the ties of x log2 e and the special values; 37 elements: vector part and scalar tail."""
    x = np.array([88.0, 88.7, 88.72, 88.73, 89.0, 100.0, -87.3, -87.4, -90.0, -100.0, -103.9, -104.0, -110.0,
                  0.5 * np.log(2), 1.5 * np.log(2), -2.5 * np.log(2), 1.0, -1.0, 0.1, -0.1, 20.0, -20.0,
                  60.0, -60.0, 1e-7, -1e-7, 7.0] + SPECIAL, np.float32)
    _assert_close(_unary_model("Exp", x.shape), {"x": x}, rtol=2e-6, atol=0.0)


def test_erf_at_large_tiny_and_special_values_equals_onnxruntime():
    x = np.concatenate([np.array(SPECIAL, np.float32), np.linspace(-6, 6, 101, dtype=np.float32),
                        np.array([3.9, 3.99, 4.0, 4.01, -3.99, -4.01, 10.0, -10.0, 1e-8, -1e-8, 1e-20], np.float32)])
    _assert_close(_unary_model("Erf", x.shape), {"x": x}, rtol=2e-6, atol=1e-7)


def _gelu_diamond_model(shape, extra_outputs=()):
    consts = [helper.make_tensor(n, T.FLOAT, [], [v]) for n, v in (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["x", "p"], ["xp"]),
             helper.make_node("Mul", ["xp", "half"], ["y"])]
    outputs = [helper.make_tensor_value_info(n, T.FLOAT, shape) for n in ("y", *extra_outputs)]
    return make_model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, shape)], outputs, consts)


def _kernels(model) -> list[str]:
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    wat = compile_graph(graph, parse_options(None, "simd,relaxed-simd", "3")).wat
    return [line.split(";;")[1].strip() for line in wat.splitlines() if line.startswith("  (func $") and ";;" in line]


def test_an_erf_gelu_diamond_no_kernel_absorbs_runs_as_one_loop_bit_for_bit_as_five():
    assert _kernels(_gelu_diamond_model([4, 64])) == ["Div"]
    x = (3 * RNG.standard_normal((4, 64))).astype(np.float32)
    for features, level in CONFIGS:
        one = run_wasm(_gelu_diamond_model([4, 64]), {"x": x}, features, level)["y"]
        five = run_wasm(_gelu_diamond_model([4, 64], extra_outputs=("e",)), {"x": x}, features, level)["y"]
        np.testing.assert_array_equal(one, five, err_msg=f"features={features!r}")


def test_an_erf_gelu_diamond_whose_inner_value_is_an_output_keeps_its_five_loops():
    model = _gelu_diamond_model([2, 9], extra_outputs=("e",))
    assert _kernels(model) == ["Div", "Erf", "Add", "Mul", "Mul"]
    _assert_close(model, {"x": (3 * RNG.standard_normal((2, 9))).astype(np.float32)}, rtol=1e-5, atol=1e-6)


def test_erf_gelu_diamond_equals_onnxruntime_on_an_odd_size():
    shape = [3, 37]
    model = _gelu_diamond_model(shape)
    x = (3 * RNG.standard_normal(shape)).astype(np.float32)
    x[0, :4] = [-10.0, 10.0, 0.0, -1e-30]
    # for x < -3, 1 + erf(x / sqrt 2) cancels: erf's last-bit error near -1 (6e-8) times |x| is an
    # absolute error, relative to a result near 0
    _assert_close(model, {"x": x}, rtol=1e-5, atol=1e-6)


def _dynamic_quantize_model(shape):
    return make_model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero"])],
                      [helper.make_tensor_value_info("x", T.FLOAT, list(shape))],
                      [helper.make_tensor_value_info("y", T.UINT8, None),
                       helper.make_tensor_value_info("scale", T.FLOAT, None),
                       helper.make_tensor_value_info("zero", T.UINT8, None)])


@pytest.mark.parametrize("shape", [(5,), (17,), (3, 131), (128, 384)])
def test_dynamic_quantize_linear_is_bit_exact_at_odd_sizes(shape):
    x = (3 * RNG.standard_normal(shape)).astype(np.float32)
    x.flat[0], x.flat[-1] = 7.5, -2.25            # the range's ends land in the vector part and in the tail
    model = _dynamic_quantize_model(shape)
    want = run_onnxruntime(model, {"x": x})
    for features, level in CONFIGS:
        got = run_wasm(model, {"x": x}, features, level)
        for name, expected in want.items():
            assert got[name].dtype == expected.dtype
            np.testing.assert_array_equal(got[name], expected, err_msg=f"{name}, features={features!r}")


def test_dynamic_quantize_linear_stores_0_and_255_at_the_range_ends():
    x = np.array([-3.0, 5.0, 0.0, -3.0, 5.0, 1.0, 4.999, -2.999, 0.001], np.float32)
    model = _dynamic_quantize_model(x.shape)
    want = run_onnxruntime(model, {"x": x})
    got = run_wasm(model, {"x": x}, "simd,relaxed-simd", "3")
    np.testing.assert_array_equal(got["y"], want["y"])
    assert got["y"][0] == 0 and got["y"][1] == 255


def test_dynamic_quantize_linear_quantises_without_saturating_conversions():
    """The quantisation loop clamps with pmax/pmin and converts by adding 2^23: no NaN-propagating
    f32x4.min/max and no saturating truncation, the long sequences on x86."""
    graph, _ = run_pipeline(import_model(_dynamic_quantize_model((4, 64))), optimize_pipeline(require_static=True))
    wat = compile_graph(graph, parse_options(None, "simd", "2")).wat
    assert "v128.store32_lane" in wat and "i32x4.trunc_sat_f32x4_s" not in wat
    assert "f32x4.min" not in wat.replace("f32x4.pmin", "") and "f32x4.max" not in wat.replace("f32x4.pmax", "")


def _quantize_linear_model(shape, zero_type, axis_size=None):
    scale_shape = [axis_size] if axis_size else []
    return make_model([helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["y"], axis=1)],
                      [helper.make_tensor_value_info("x", T.FLOAT, list(shape))],
                      [helper.make_tensor_value_info("y", zero_type, list(shape))],
                      [helper.make_tensor("scale", T.FLOAT, scale_shape, [0.02] * (axis_size or 1)),
                       helper.make_tensor("zero", zero_type, scale_shape, [3] * (axis_size or 1))])


@pytest.mark.parametrize("zero_type", [T.UINT8, T.INT8])
@pytest.mark.parametrize("shape, axis_size", [((7,), None), ((3, 131), None), ((2, 5, 9), 5)])
def test_quantize_linear_is_bit_exact_at_odd_sizes_and_its_saturation(zero_type, shape, axis_size):
    x = (3 * RNG.standard_normal(shape)).astype(np.float32)
    x.flat[:6] = [0.01, 0.03, -0.05, 1e9, np.nan, -np.inf]   # ties of x / scale, past the range, NaN
    model = _quantize_linear_model(shape, zero_type, axis_size)
    want = run_onnxruntime(model, {"x": x})["y"]
    for features, level in CONFIGS:
        np.testing.assert_array_equal(run_wasm(model, {"x": x}, features, level)["y"], want,
                                      err_msg=f"features={features!r}")
