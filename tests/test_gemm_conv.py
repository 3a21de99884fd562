"""Conv lowered to im2col + the WASM GEMM kernel, against onnxruntime's Conv."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from backends.wasm.gemm import SCALAR, SIMD, SIMD_FMA
from backends.wasm.kernels.conv import Conv2dSpec, conv_scratch_bytes, render_conv2d
from backends.wasm.kernels.standalone import instantiate, read, write


def onnxruntime_conv(spec: Conv2dSpec, x, w, bias):
    kh, kw = spec.kernel
    inputs = ["x", "w"] + (["b"] if bias is not None else [])
    node = helper.make_node("Conv", inputs, ["y"], kernel_shape=[kh, kw], strides=list(spec.strides),
                            pads=list(spec.pads[:2]) + list(spec.pads[2:]), dilations=list(spec.dilations),
                            group=spec.groups)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "w": w, **({"b": bias} if bias is not None else {})}
    return session.run(None, feeds)[0]


def run_conv(spec: Conv2dSpec, x, w, bias, residual, epilogue, features):
    y_shape = (spec.batch, spec.out_channels, spec.out_height, spec.out_width)
    layout, end = {}, 32
    for key, size in (("x", x.nbytes), ("w", w.nbytes), ("b", spec.out_channels * 4),
                      ("y", int(np.prod(y_shape)) * 4), ("r", int(np.prod(y_shape)) * 4),
                      ("scratch", conv_scratch_bytes(spec))):
        layout[key], end = end, end + size + 16
    funcs = render_conv2d(spec, x_offset=layout["x"], w_offset=layout["w"], y_offset=layout["y"],
                          scratch_offset=layout["scratch"], bias_offset=layout["b"] if bias is not None else None,
                          residual_offset=layout["r"] if residual is not None else None, epilogue=epilogue,
                          features=features)
    store, inst = instantiate(funcs, end, features)
    write(store, inst, layout["x"], x)
    write(store, inst, layout["w"], w)
    write(store, inst, layout["scratch"], np.full(conv_scratch_bytes(spec) // 4, np.nan, np.float32))
    if bias is not None:
        write(store, inst, layout["b"], bias)
    if residual is not None:
        write(store, inst, layout["r"], residual)
    inst.exports(store)["conv"](store)
    return read(store, inst, layout["y"], y_shape)


SPECS = {
    "3x3-pad1": Conv2dSpec(1, 3, 9, 11, 8, (3, 3), pads=(1, 1, 1, 1)),
    "7x7-stride2-pad3": Conv2dSpec(1, 3, 20, 18, 16, (7, 7), strides=(2, 2), pads=(3, 3, 3, 3)),
    "pointwise": Conv2dSpec(1, 16, 4, 8, 20, (1, 1)),
    "pointwise-odd-pixels": Conv2dSpec(1, 5, 3, 7, 4, (1, 1)),
    "grouped": Conv2dSpec(1, 8, 6, 6, 12, (3, 3), pads=(1, 1, 1, 1), groups=4),
    "depthwise-stride2": Conv2dSpec(1, 6, 9, 9, 6, (3, 3), strides=(2, 2), pads=(1, 1, 1, 1), groups=6),
    "dilated-asymmetric-pads": Conv2dSpec(1, 4, 10, 12, 5, (3, 2), pads=(2, 0, 1, 1), dilations=(2, 3)),
    "batch-of-two": Conv2dSpec(2, 3, 7, 7, 4, (3, 3), pads=(1, 1, 1, 1)),
    "wide-image-packs-a": Conv2dSpec(1, 3, 24, 20, 9, (3, 3), pads=(1, 1, 1, 1)),  # 480 pixels >= 384
    # depthwise: the direct kernel (kernels/depthwise.py), not im2col
    "depthwise-3x3-batch-of-two": Conv2dSpec(2, 5, 7, 10, 5, (3, 3), pads=(1, 1, 1, 1), groups=5),
    "depthwise-5x5-stride3-asymmetric-pads": Conv2dSpec(1, 4, 11, 13, 4, (5, 5), strides=(3, 3), pads=(2, 1, 0, 2), groups=4),
    "depthwise-dilated": Conv2dSpec(1, 3, 12, 9, 3, (3, 2), pads=(2, 0, 1, 1), dilations=(2, 3), groups=3),
    "depthwise-7x7-keeps-weights-in-memory": Conv2dSpec(1, 2, 9, 9, 2, (7, 7), pads=(3, 3, 3, 3), groups=2),
}


@pytest.mark.parametrize("features", [SIMD_FMA, SIMD, SCALAR], ids=["relaxed-simd", "simd", "scalar"])
@pytest.mark.parametrize("name", SPECS)
def test_conv_as_gemm_matches_onnxruntime(name, features):
    spec = SPECS[name]
    rng = np.random.default_rng(len(name))
    x = rng.standard_normal((spec.batch, spec.in_channels, spec.height, spec.width)).astype(np.float32)
    w = rng.standard_normal((spec.out_channels, spec.in_channels // spec.groups, *spec.kernel)).astype(np.float32)
    bias = rng.standard_normal(spec.out_channels).astype(np.float32)
    want = onnxruntime_conv(spec, x, w, bias)
    got = run_conv(spec, x, w, bias, None, None, features)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_epilogue_adds_the_residual_then_applies_relu():
    spec = SPECS["3x3-pad1"]
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 3, 9, 11)).astype(np.float32)
    w = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    residual = rng.standard_normal((1, 8, 9, 11)).astype(np.float32)
    want = np.maximum(onnxruntime_conv(spec, x, w, None) + residual, 0)
    got = run_conv(spec, x, w, None, residual, "relu", SIMD_FMA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_conv_with_no_output_pixels_is_refused():
    with pytest.raises(ValueError, match="empty"):
        Conv2dSpec(1, 3, 2, 2, 4, (5, 5))


@pytest.mark.parametrize("features", [SIMD_FMA, SCALAR], ids=["relaxed-simd", "scalar"])
def test_depthwise_conv_without_bias_adds_the_residual_then_applies_relu(features):
    spec = SPECS["depthwise-stride2"]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 6, 9, 9)).astype(np.float32)
    w = rng.standard_normal((6, 1, 3, 3)).astype(np.float32)
    residual = rng.standard_normal((1, 6, 5, 5)).astype(np.float32)
    want = np.maximum(onnxruntime_conv(spec, x, w, None) + residual, 0)
    got = run_conv(spec, x, w, None, residual, "relu", features)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_depthwise_conv_runs_directly_on_a_padded_plane_instead_of_im2col():
    spec = Conv2dSpec(1, 136, 28, 28, 136, (3, 3), pads=(1, 1, 1, 1), groups=136)  # ShuffleNet's
    assert conv_scratch_bytes(spec) == 30 * 30 * 4     # one zero-bordered plane, vs 9 x 136 x 784 floats
    wat = render_conv2d(spec, x_offset=0, w_offset=0, y_offset=0, scratch_offset=0, features=SIMD_FMA)
    assert "im2col" not in wat and "depthwise" in wat
