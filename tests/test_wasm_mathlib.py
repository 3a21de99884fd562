"""The WAT math library (WebAssembly has no exp, log, erf, trig...) is accurate to float64 rounding
over wide ranges and handles the special values, so float32 results round exactly like a libm's.
Its f32x4 versions, which vectorised float32 loops call, are within a few float32 ulps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

from backends.wasm.compile import compile_graph
from backends.wasm.options import parse_options
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from wasm_cases import assert_matches_onnxruntime, make_model, run_wasm


def run_f64(op, x):
    model = make_model([helper.make_node(op, ["x"], ["y"])], [helper.make_tensor_value_info("x", T.DOUBLE, [x.size])],
                       [helper.make_tensor_value_info("y", T.DOUBLE, [x.size])])
    return run_wasm(model, {"x": x}, "", "0")["y"]


@pytest.mark.parametrize("op,reference,x", [
    ("Exp", np.exp, np.linspace(-700, 700, 20001)),
    ("Log", np.log, np.logspace(-307, 307, 20001)),
    ("Tanh", np.tanh, np.linspace(-30, 30, 20001)),
    ("Erf", np.vectorize(math.erf), np.concatenate([np.linspace(-7, 7, 20001), np.logspace(-30, 0.5, 301)])),
    ("Sin", np.sin, np.linspace(-100, 100, 20001)),
    ("Cos", np.cos, np.linspace(-100, 100, 20001)),
    ("Atan", np.arctan, np.linspace(-1e3, 1e3, 20001)),
    ("Asinh", np.arcsinh, np.linspace(-1e3, 1e3, 20001)),
])
def test_math_functions_are_accurate_to_a_few_float64_ulps(op, reference, x):
    got, want = run_f64(op, x), reference(x)
    relative = np.abs(got - want) / np.maximum(np.abs(want), 1e-300)
    # sin and cos lose relative accuracy only next to their zeros, where the absolute error still is tiny
    assert np.max(np.where(np.abs(want) > 1e-6, relative, np.abs(got - want))) < 1e-13


@pytest.mark.parametrize("op,x,want", [
    ("Exp", [np.inf, -np.inf, np.nan, 800.0, -800.0], [np.inf, 0.0, np.nan, np.inf, 0.0]),
    ("Log", [0.0, -1.0, np.inf, np.nan, 1.0], [-np.inf, np.nan, np.inf, np.nan, 0.0]),
    ("Erf", [np.inf, -np.inf, np.nan, 0.0, 10.0], [1.0, -1.0, np.nan, 0.0, 1.0]),
    ("Tanh", [np.inf, -np.inf, np.nan, 0.0, 1e-300], [1.0, -1.0, np.nan, 0.0, 1e-300]),
])
def test_special_values(op, x, want):
    np.testing.assert_array_equal(run_f64(op, np.array(x)), np.array(want))


def test_pow_follows_the_c_rules_for_signs_and_zeros():
    base = np.array([-2.0, -2.0, 0.0, 0.0, -0.0, 4.0, np.nan, 1.5, -8.0], dtype=np.float64)
    expo = np.array([3.0, 0.5, -1.0, 2.0, 3.0, 0.5, 0.0, 2.5, 1 / 3], dtype=np.float64)
    model = make_model([helper.make_node("Pow", ["a", "b"], ["y"])],
                       [helper.make_tensor_value_info("a", T.DOUBLE, [9]), helper.make_tensor_value_info("b", T.DOUBLE, [9])],
                       [helper.make_tensor_value_info("y", T.DOUBLE, [9])])
    got = run_wasm(model, {"a": base, "b": expo}, "", "0")["y"]
    with np.errstate(invalid="ignore", divide="ignore"):      # (-8) ** (1/3) is NaN, 0 ** -1 is inf
        want = np.power(base, expo)
    np.testing.assert_allclose(got, want, rtol=1e-14)


# --- the f32x4 versions the vectoriser calls in float32 loops -------------------------------------

def compile_f32(op, x, features="simd"):
    model = make_model([helper.make_node(op, ["x"], ["y"])], [helper.make_tensor_value_info("x", T.FLOAT, [x.size])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [x.size])])
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    wat = compile_graph(graph, parse_options(None, features, "3")).wat
    return run_wasm(model, {"x": x}, features, "3")["y"], wat


def float32_ulps(got, want):
    """|got - want| in units of the float32 spacing at the float64 reference."""
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)


_erf = np.vectorize(math.erf)


@pytest.mark.parametrize("op", ["Exp", "Log", "Tanh", "Erf"])
def test_float32_loops_with_simd_call_the_vector_function(op):
    x = np.linspace(0.5, 2, 64, dtype=np.float32)
    _, vector_wat = compile_f32(op, x, "simd")
    _, scalar_wat = compile_f32(op, x, "")
    name = f"{op.lower()}_f32x4"      # called, or written inline (exp, log, erf at opt-level 3)
    assert name in vector_wat and name not in scalar_wat


def test_float64_loops_keep_the_scalar_functions():
    model = make_model([helper.make_node("Exp", ["x"], ["y"])], [helper.make_tensor_value_info("x", T.DOUBLE, [64])],
                       [helper.make_tensor_value_info("y", T.DOUBLE, [64])])
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    assert "exp_f32x4" not in compile_graph(graph, parse_options(None, "simd", "3")).wat


@pytest.mark.parametrize("op,reference,x,max_ulps", [
    ("Exp", np.exp, np.linspace(-87, 88.7, 100003), 2),           # normal float32 results up to FLT_MAX
    ("Log", np.log, np.logspace(-45, 38.5, 100003), 2),            # subnormal arguments included
    ("Log", np.log, np.linspace(0.5, 2, 100003), 2),               # around the zero at 1
    ("Tanh", np.tanh, np.linspace(-12, 12, 100003), 2),
    ("Tanh", np.tanh, np.logspace(-40, 0, 1003), 2),
])
def test_vector_functions_are_within_a_few_float32_ulps(op, reference, x, max_ulps):
    x = x.astype(np.float32)
    got, _ = compile_f32(op, x)
    want = reference(x.astype(np.float64))
    normal = np.abs(want) >= np.finfo(np.float32).tiny
    assert np.max(float32_ulps(got, want)[normal]) <= max_ulps


def test_vector_exp_of_subnormal_results_is_accurate_to_the_smallest_subnormal():
    x = np.linspace(-104, -87, 10001, dtype=np.float32)
    got, _ = compile_f32("Exp", x)
    assert np.max(np.abs(got - np.exp(x.astype(np.float64)))) <= 2 * 1.4e-45


@pytest.mark.parametrize("x", [np.linspace(-6, 6, 100003), np.logspace(-40, 0.6, 2003), -np.logspace(-40, 0.6, 2003)])
def test_vector_erf_is_accurate_to_1e_6_relative(x):
    x = x.astype(np.float32)
    got, _ = compile_f32("Erf", x)
    want = _erf(x.astype(np.float64))
    normal = np.abs(want) >= np.finfo(np.float32).tiny
    assert np.max(np.abs(got - want)[normal] / np.abs(want)[normal]) < 1e-6
    # subnormal results have no relative accuracy to speak of: a few of the smallest steps
    assert np.max(np.abs(got - want)[~normal], initial=0) <= 8 * 1.4e-45


@pytest.mark.parametrize("op,x,want", [
    ("Exp", [np.inf, -np.inf, np.nan, 89.0, 1e30, -104.0, -1e30, 0.0], [np.inf, 0, np.nan, np.inf, np.inf, 0, 0, 1]),
    ("Log", [0.0, -0.0, -1.0, -np.inf, np.inf, np.nan, 1.0, 1e-45],
     [-np.inf, -np.inf, np.nan, np.nan, np.inf, np.nan, 0, np.log(1.401298464324817e-45)]),
    ("Erf", [np.inf, -np.inf, np.nan, 0.0, 10.0, -10.0, 4.0, -4.0], [1, -1, np.nan, 0, 1, -1, 1, -1]),
    ("Tanh", [np.inf, -np.inf, np.nan, 0.0, 1e-30, 100.0, -100.0, 10.0], [1, -1, np.nan, 0, 1e-30, 1, -1, 1]),
])
def test_vector_special_values(op, x, want):
    got, _ = compile_f32(op, np.array(x, dtype=np.float32))
    np.testing.assert_array_equal(got, np.array(want, dtype=np.float32))


@pytest.mark.parametrize("op,attrs,vector_function", [
    ("Sigmoid", {}, "exp_f32x4"), ("Softmax", {"axis": -1}, "exp_f32x4"), ("Gelu", {}, "erf_f32x4"),
    ("Softplus", {}, "log_f32x4"), ("Mish", {}, "tanh_f32x4"),
])
def test_activations_on_the_vector_functions_match_onnxruntime(op, attrs, vector_function):
    model = make_model([helper.make_node(op, ["x"], ["y"], **attrs)], [helper.make_tensor_value_info("x", T.FLOAT, [8, 67])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [8, 67])], opset=20)
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    assert vector_function in compile_graph(graph, parse_options(None, "simd", "3")).wat   # called or inline
    x = np.random.default_rng(0).normal(0, 6, (8, 67)).astype(np.float32)
    assert_matches_onnxruntime(model, {"x": x}, configs=[("simd", "3"), ("simd,relaxed-simd", "3")])


def run_pow_f32(base, expo):
    n = base.size
    model = make_model([helper.make_node("Pow", ["a", "b"], ["y"])],
                       [helper.make_tensor_value_info("a", T.FLOAT, [n]), helper.make_tensor_value_info("b", T.FLOAT, [n])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [n])])
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    assert "call $pow_f32x4" in compile_graph(graph, parse_options(None, "simd", "3")).wat
    return run_wasm(model, {"a": base, "b": expo}, "simd", "3")["y"]


def test_vector_pow_error_grows_only_with_the_size_of_y_log_x():
    rng = np.random.default_rng(0)
    base = np.exp(rng.uniform(-20, 20, 100003)).astype(np.float32)
    expo = rng.uniform(-4, 4, 100003).astype(np.float32)
    got = run_pow_f32(base, expo)
    want = np.power(base.astype(np.float64), expo.astype(np.float64))
    scale = np.abs(expo * np.log(base.astype(np.float64)))
    keep = (want > np.finfo(np.float32).tiny) & (want < np.finfo(np.float32).max)
    assert np.max((float32_ulps(got, want) / (2 * scale + 4))[keep]) <= 1


def test_vector_pow_follows_the_c_rules_for_signs_and_zeros():
    base = np.array([-2, -2, 0, 0, -0.0, 4, np.nan, 1.5, -8, -np.inf, -np.inf, 7, np.nan], dtype=np.float32)
    expo = np.array([3, 0.5, -1, 2, 3, 0.5, 0, 2.5, 1 / 3, 3, -3, np.nan, 0], dtype=np.float32)
    got = run_pow_f32(base, expo)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = np.power(base, expo)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    numbers = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))


def test_lrn_on_the_vector_pow_matches_onnxruntime():
    model = make_model([helper.make_node("LRN", ["x"], ["y"], size=5, alpha=1e-4, beta=0.75, bias=2.0)],
                       [helper.make_tensor_value_info("x", T.FLOAT, [1, 16, 9, 9])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [1, 16, 9, 9])])
    x = np.random.default_rng(1).normal(0, 30, (1, 16, 9, 9)).astype(np.float32)
    assert_matches_onnxruntime(model, {"x": x}, configs=[("simd", "3"), ("simd,relaxed-simd", "3")])
