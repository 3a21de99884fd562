"""DynamicQuantizeLinear on WebAssembly: both loops vectorised (the range as pmin/pmax partials, the
quantisation storing bytes from 32-bit lanes), bit-exact against onnxruntime and the scalar loop nest,
including the ranges that reach the spec's corner cases."""

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

RNG = np.random.default_rng(11)


def _model(shape):
    return make_model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero"])],
                      [helper.make_tensor_value_info("x", T.FLOAT, list(shape))],
                      [helper.make_tensor_value_info("y", T.UINT8, None),
                       helper.make_tensor_value_info("scale", T.FLOAT, None),
                       helper.make_tensor_value_info("zero", T.UINT8, None)])


def _assert_exact(x):
    model, feeds = _model(x.shape), {"x": x}
    want = run_onnxruntime(model, feeds)
    for features, level in (("simd", "2"), ("simd,relaxed-simd", "3"), ("", "0")):
        got = run_wasm(model, feeds, features, level)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, features={features!r}")
    return want


INPUTS = {
    "all-zero": np.zeros((3, 37), np.float32),
    "all-positive": RNG.uniform(0.5, 3.0, (2, 50)).astype(np.float32),
    "all-negative": -RNG.uniform(0.5, 3.0, (7, 9)).astype(np.float32),
    "mixed": RNG.standard_normal((16, 64)).astype(np.float32),
    "large": (RNG.standard_normal((5, 41)) * 1e30).astype(np.float32),
    "tiny": (RNG.standard_normal((4, 4)) * 1e-30).astype(np.float32),
    "one-element": np.array([2.5], np.float32),
    "three-elements": np.array([-1.0, 0.25, 4.0], np.float32),
}


@pytest.mark.parametrize("name", INPUTS)
def test_dynamic_quantize_linear_equals_onnxruntime(name):
    _assert_exact(INPUTS[name])


def test_an_all_zero_input_has_scale_one_as_onnxruntime_gives_it():
    want = _assert_exact(np.zeros((8,), np.float32))
    assert want["scale"] == np.float32(1.0) and want["zero"] == 0 and not want["y"].any()


def test_values_halfway_between_quanta_round_to_even():
    """x = (k + 1/2) * scale for a range whose scale is exact: every value is a tie."""
    x = np.concatenate([[0.0, 255.0], np.arange(0.5, 254.0, 1.0)]).astype(np.float32)
    want = _assert_exact(x)
    assert want["scale"] == np.float32(1.0)


def test_both_loops_are_vectorised():
    graph, _ = run_pipeline(import_model(_model((4, 64))), optimize_pipeline(require_static=True))
    wat = compile_graph(graph, parse_options(None, "simd", "2")).wat
    assert "f32x4.pmin" in wat and "f32x4.pmax" in wat and "v128.store32_lane" in wat
