"""ConvInteger and QLinearConv on the WebAssembly integer Conv kernel (kernels/int8_conv.py): bit-exact
against the loop-nest lowering (opt-level 0, and no SIMD) and against onnxruntime, over shapes, pads,
strides, dilations, groups, depthwise, u8/s8 and per-channel weights."""

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

# (channels, out channels, (h, w), kernel, strides, pads, dilations, group, batch)
GEOMETRIES = [
    (3, 8, (9, 9), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, 1),      # padded 3x3, a partial last panel
    (5, 6, (7, 11), (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, 2),     # 1x1: the input is the matrix; 2 images
    (4, 5, (13, 10), (3, 2), (2, 3), (2, 0, 1, 2), (1, 1), 1, 1),    # strides, uneven pads, odd K
    (3, 9, (12, 12), (3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 1, 1),    # dilation
    (6, 9, (8, 8), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 3, 1),      # groups
    (8, 8, (10, 9), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 8, 1),     # depthwise, stride 2
    (16, 32, (6, 6), (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 4, 1),    # grouped 1x1, 8 whole panels at 36 pixels
    (2, 3, (3, 3), (5, 5), (1, 1), (2, 2, 2, 2), (1, 1), 1, 1),      # kernel larger than the image
    (20, 36, (17, 17), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, 1),  # wide enough for full tiles and vector runs
]


def _ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _conv_model(op, geometry, x_dtype, w_dtype, per_channel, y_dtype=np.uint8, bias=True, seed=0):
    channels, out_channels, (h, w), kernel, strides, pads, dilations, group, batch = geometry
    rng = np.random.default_rng(seed)
    weight = _ints(rng, w_dtype, (out_channels, channels // group, *kernel))
    w_zero = _ints(rng, w_dtype, (out_channels,) if per_channel else ())
    x_zero = _ints(rng, x_dtype, ())
    attrs = dict(kernel_shape=list(kernel), strides=list(strides), pads=list(pads), dilations=list(dilations),
                 group=group)
    inits = [nh.from_array(weight, "w"), nh.from_array(w_zero, "w_zero"), nh.from_array(x_zero, "x_zero")]
    if op == "ConvInteger":
        node = helper.make_node(op, ["x", "w", "x_zero", "w_zero"], ["y"], **attrs)
        out_type = T.INT32
    else:
        taps = channels // group * kernel[0] * kernel[1]
        w_scale = rng.uniform(0.5, 2.0, (out_channels,) if per_channel else ()).astype(np.float32)
        inits += [nh.from_array(np.float32(0.02), "x_scale"), nh.from_array(w_scale * np.float32(0.01), "w_scale"),
                  nh.from_array(np.float32(0.0004 * np.sqrt(taps) * 120), "y_scale"),
                  nh.from_array(_ints(rng, y_dtype, ()), "y_zero")]
        names = ["x", "x_scale", "x_zero", "w", "w_scale", "w_zero", "y_scale", "y_zero"]
        if bias:
            inits.append(nh.from_array(rng.integers(-5000, 5000, out_channels).astype(np.int32), "bias"))
            names.append("bias")
        node = helper.make_node(op, names, ["y"], **attrs)
        out_type = ONNX_TYPE[y_dtype]
    model = make_model([node], [helper.make_tensor_value_info("x", ONNX_TYPE[x_dtype], [batch, channels, h, w])],
                       [helper.make_tensor_value_info("y", out_type, None)], inits)
    return model, {"x": _ints(rng, x_dtype, (batch, channels, h, w))}


def _wat(model, features="simd"):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return compile_graph(graph, parse_options(None, features, "2")).wat


def _assert_kernel_equals_loop_nest_and_onnxruntime(model, feeds, onnxruntime=True):
    assert "i32x4.dot_i16x8_s" in _wat(model), "the Conv did not reach the integer kernel"
    kernel = run_wasm(model, feeds, "simd", "2")["y"]
    loop_nest = run_wasm(model, feeds, "", "0")["y"]
    assert kernel.dtype == loop_nest.dtype and kernel.shape == loop_nest.shape
    np.testing.assert_array_equal(kernel, loop_nest)
    if onnxruntime:
        np.testing.assert_array_equal(kernel, run_onnxruntime(model, feeds)["y"])


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"c{g[0]}-o{g[1]}-k{g[3][0]}{g[3][1]}-s{g[4][0]}-g{g[7]}")
@pytest.mark.parametrize("x_dtype, w_dtype, per_channel", [(np.uint8, np.int8, False), (np.uint8, np.uint8, True)])
def test_conv_integer_equals_the_loop_nest_and_onnxruntime(geometry, x_dtype, w_dtype, per_channel):
    # onnxruntime's ConvInteger takes uint8 x and a per-tensor weight zero point only
    model, feeds = _conv_model("ConvInteger", geometry, x_dtype, w_dtype, per_channel)
    _assert_kernel_equals_loop_nest_and_onnxruntime(model, feeds, onnxruntime=not per_channel)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"c{g[0]}-o{g[1]}-k{g[3][0]}{g[3][1]}-s{g[4][0]}-g{g[7]}")
@pytest.mark.parametrize("x_dtype, w_dtype, y_dtype, per_channel",
                         [(np.uint8, np.int8, np.uint8, True), (np.int8, np.int8, np.int8, False)])
def test_qlinear_conv_equals_the_loop_nest_and_onnxruntime(geometry, x_dtype, w_dtype, y_dtype, per_channel):
    model, feeds = _conv_model("QLinearConv", geometry, x_dtype, w_dtype, per_channel, y_dtype)
    _assert_kernel_equals_loop_nest_and_onnxruntime(model, feeds)


@pytest.mark.parametrize("bias", [False, True])
def test_qlinear_conv_with_uint8_weights_and_no_bias_equals_onnxruntime(bias):
    model, feeds = _conv_model("QLinearConv", GEOMETRIES[0], np.uint8, np.uint8, True, np.uint8, bias=bias, seed=3)
    _assert_kernel_equals_loop_nest_and_onnxruntime(model, feeds)


def test_conv_integer_without_zero_points_equals_onnxruntime():
    rng = np.random.default_rng(5)
    weight = _ints(rng, np.int8, (4, 3, 3, 3))
    model = make_model([helper.make_node("ConvInteger", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
                       [helper.make_tensor_value_info("x", T.UINT8, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", T.INT32, None)], [nh.from_array(weight, "w")])
    _assert_kernel_equals_loop_nest_and_onnxruntime(model, {"x": _ints(rng, np.uint8, (1, 3, 8, 8))})


def test_requantisation_saturates_both_ways():
    """Large scales push most outputs past the 8-bit range: saturation must match exactly."""
    model, feeds = _conv_model("QLinearConv", GEOMETRIES[4], np.int8, np.int8, True, np.int8)
    for init in model.graph.initializer:
        if init.name == "y_scale":
            init.CopyFrom(nh.from_array(np.float32(0.0005), "y_scale"))
    _assert_kernel_equals_loop_nest_and_onnxruntime(model, feeds)


def test_a_weight_computed_at_run_time_stays_a_loop_nest():
    model, _ = _conv_model("ConvInteger", GEOMETRIES[0], np.uint8, np.int8, False)
    model.graph.initializer.remove(next(i for i in model.graph.initializer if i.name == "w"))
    model.graph.input.append(helper.make_tensor_value_info("w", T.INT8, [8, 3, 3, 3]))
    assert "i32x4.dot_i16x8_s" not in _wat(model)
