"""The int8 variant's Convs multiply integers: a 2-D Conv with a constant float32 weight becomes
DynamicQuantizeLinear(X) -> ConvInteger(codes) -> Cast -> Mul(x_scale * scale[c]) [-> Add(bias[c])],
which runs on the wasm integer Conv kernel (no loop nest) and computes what onnxruntime computes on
the same graph built here from the weight's per-output-channel int8 codes; Convs reading the same X
share its quantization. A Conv with fewer than MIN_CONV_TAPS taps per output (a depthwise one, a first
RGB layer) keeps the weight-only form; so does every Conv without integer_gemm."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from test_narrow_weight_kernels import FEATURES, compiled, kernels, run
from testdata import run_onnxruntime
from wasm_cases import make_model

from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.narrow_weights import narrowed

INTEGER_FORM = ["DynamicQuantizeLinear", "Mul", "ConvInteger", "Cast", "Mul"]


def conv_model(batch: int, channels: int, size: tuple[int, int], out_channels: int, kernel: int, *,
               stride: int = 1, pad: int = 0, group: int = 1, bias: bool = True, seed: int = 0):
    """y = Conv(x, W [, b]) on a float32 x of [batch, channels, *size]."""
    rng = np.random.default_rng(seed)
    fan_in = channels // group * kernel * kernel
    w = (rng.standard_normal((out_channels, channels // group, kernel, kernel)) / np.sqrt(fan_in)).astype(np.float32)
    inits, names = [numpy_helper.from_array(w, "w")], ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(out_channels).astype(np.float32), "b"))
        names.append("b")
    node = helper.make_node("Conv", names, ["y"], kernel_shape=[kernel, kernel], strides=[stride, stride],
                            pads=[pad] * 4, group=group)
    return make_model([node], [helper.make_tensor_value_info("x", T.FLOAT, [batch, channels, *size])],
                      [helper.make_tensor_value_info("y", T.FLOAT, None)], inits)


def dynamic_quantize_conv(model):
    """The integer form built by hand from W's int8 codes per output channel (numpy, not the pass),
    for onnxruntime to run: DynamicQuantizeLinear -> ConvInteger -> Cast -> Mul [-> Add]."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    conv = model.graph.node[0]
    w = inits["w"]
    scale = np.abs(w).max(axis=(1, 2, 3)) / np.float32(127)
    codes = np.clip(np.rint(w / scale.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
    per_channel = (1, w.shape[0], 1, 1)
    tensors = [numpy_helper.from_array(codes, "codes"),
               numpy_helper.from_array(scale.astype(np.float32).reshape(per_channel), "w_scale")]
    last = "y" if "b" not in inits else "scaled"
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "x_scale", "x_zero"]),
             helper.make_node("ConvInteger", ["xq", "codes", "x_zero"], ["sums"]),
             helper.make_node("Cast", ["sums"], ["widened"], to=T.FLOAT),
             helper.make_node("Mul", ["x_scale", "w_scale"], ["scale"]),
             helper.make_node("Mul", ["widened", "scale"], [last])]
    nodes[1].attribute.extend(conv.attribute)
    if "b" in inits:
        tensors.append(numpy_helper.from_array(inits["b"].reshape(per_channel), "b"))
        nodes.append(helper.make_node("Add", ["scaled", "b"], ["y"]))
    return make_model(nodes, list(model.graph.input), list(model.graph.output), tensors)


def variant_graph(model, integer_gemm: bool = True):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return narrowed(graph, "int8", integer_gemm)


def relative_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("features", FEATURES, ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("batch,channels,size,out_channels,kernel,stride,pad,group,bias", [
    (1, 8, (12, 12), 16, 3, 1, 1, 1, True),
    (2, 8, (12, 12), 16, 3, 1, 1, 1, False),
    (1, 6, (11, 13), 10, 3, 2, 1, 1, True),
    (2, 32, (9, 9), 24, 1, 1, 0, 1, True),
    (1, 40, (7, 7), 20, 1, 1, 0, 1, False),
    (1, 16, (10, 10), 32, 3, 1, 1, 4, True)],          # grouped: 4 input channels per group, 36 taps
    ids=["3x3-pad1", "3x3-batch2-no-bias", "3x3-stride2", "1x1-batch2", "1x1-no-bias", "grouped"])
def test_a_conv_runs_on_the_integer_conv_kernel_as_onnxruntime_runs_its_integer_form(
        batch, channels, size, out_channels, kernel, stride, pad, group, bias, features):
    model = conv_model(batch, channels, size, out_channels, kernel, stride=stride, pad=pad, group=group, bias=bias,
                       seed=channels + out_channels)
    graph = variant_graph(model)
    assert [node.op_type for node in graph.nodes] == INTEGER_FORM + (["Add"] if bias else [])
    artifact = compiled(graph, features)
    assert "ConvInteger" in kernels(artifact)
    assert "i32x4.dot_i16x8_s" in artifact.wat, "the ConvInteger ran as a loop nest"
    feeds = {"x": np.random.default_rng(out_channels).standard_normal((batch, channels, *size)).astype(np.float32)}
    got = run(artifact, features, feeds)
    want = run_onnxruntime(dynamic_quantize_conv(model), feeds)["y"]
    # Integer sums are exact; the scale and bias are rounded to float32 as onnxruntime rounds them.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = run_onnxruntime(model, feeds)["y"]
    # 8-bit activations (steps of range / 255) and weights (max|w| / 127): about 1% relative L2.
    assert 1e-4 < relative_l2(got, exact) < 3e-2


def test_padding_adds_nothing_where_zero_is_not_the_inputs_zero_point():
    """All-positive x: x_zero is 0 then; shifted negative, x_zero is 255 and the border taps must
    still add 0, as the float Conv's zero padding does (a wrong pad value shows on the border)."""
    model = conv_model(1, 4, (6, 6), 8, 3, pad=1, bias=False, seed=3)
    artifact = compiled(variant_graph(model), "simd,bulk-memory")
    x = np.random.default_rng(4).uniform(1.0, 2.0, (1, 4, 6, 6)).astype(np.float32)
    for feed in (x, -x):
        got = run(artifact, "simd,bulk-memory", {"x": feed})
        exact = run_onnxruntime(model, {"x": feed})["y"]
        border = np.ones(exact.shape, bool)
        border[..., 1:-1, 1:-1] = False
        assert relative_l2(got[border], exact[border]) < 3e-2


def test_convs_reading_the_same_input_share_its_quantization():
    rng = np.random.default_rng(6)
    w1, w3 = (rng.standard_normal(shape).astype(np.float32) * 0.1 for shape in ((24, 16, 1, 1), (24, 16, 3, 3)))
    w1 = np.concatenate([w1] * 2, axis=1)           # 32 taps: the 1x1 reads the input twice over
    nodes = [helper.make_node("Concat", ["x", "x"], ["xx"], axis=1),
             helper.make_node("Conv", ["xx", "w1"], ["a"], kernel_shape=[1, 1]),
             helper.make_node("Conv", ["xx", "w3"], ["b"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=2),
             helper.make_node("Concat", ["a", "b"], ["y"], axis=1)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [1, 16, 8, 8])],
                       [helper.make_tensor_value_info("y", T.FLOAT, None)],
                       [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w3, "w3")])
    graph = variant_graph(model)
    assert [node.op_type for node in graph.nodes].count("DynamicQuantizeLinear") == 1
    assert [node.op_type for node in graph.nodes].count("ConvInteger") == 2
    feeds = {"x": rng.standard_normal((1, 16, 8, 8)).astype(np.float32)}
    got = run(compiled(graph, "simd,bulk-memory"), "simd,bulk-memory", feeds)
    assert 1e-4 < relative_l2(got, run_onnxruntime(model, feeds)["y"]) < 3e-2


@pytest.mark.parametrize("channels,out_channels,kernel,group", [
    (16, 16, 3, 16),        # depthwise: 9 taps
    (8, 16, 3, 8),          # one input channel per group, two outputs each: 9 taps
    (3, 16, 3, 1),          # a first RGB layer: 27 taps
    (16, 32, 1, 1)])        # 1x1 over 16 channels
def test_a_conv_of_few_taps_keeps_the_weight_only_form(channels, out_channels, kernel, group):
    model = conv_model(1, channels, (12, 12), out_channels, kernel, pad=kernel // 2, group=group)
    graph = variant_graph(model)
    assert [node.op_type for node in graph.nodes] == ["Cast", "Mul", "Conv"]
    feeds = {"x": np.random.default_rng(5).standard_normal((1, channels, 12, 12)).astype(np.float32)}
    got = run(compiled(graph, "simd,bulk-memory"), "simd,bulk-memory", feeds)
    assert relative_l2(got, run_onnxruntime(model, feeds)["y"]) < 3e-2


def test_without_integer_gemm_a_conv_keeps_the_weight_only_form():
    graph = variant_graph(conv_model(1, 8, (8, 8), 16, 3, pad=1), integer_gemm=False)
    assert [node.op_type for node in graph.nodes] == ["Cast", "Mul", "Conv"]
