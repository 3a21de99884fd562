"""The WAT math library (WebAssembly has no exp, log, erf, trig...) is accurate to float64 rounding
over wide ranges and handles the special values, so float32 results round exactly like a libm's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

from wasm_cases import make_model, run_wasm


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
