"""Conv lowered to the WASM GEMM kernel, against onnxruntime's Conv: im2col (the weight as A) and the
implicit GEMM over output pixels (the weight as packed B, kernels/conv_implicit_gemm.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from backends.wasm import gemm
from backends.wasm.gemm import SCALAR, SIMD, SIMD_FMA
from backends.wasm.intrinsics import conv_kernel_spec
from backends.wasm.kernels import conv
from backends.wasm.kernels.conv import (Conv2dSpec, conv_scratch_bytes, im2col_chunk_rows, pack_conv_weight,
                                        render_conv2d, weight_packs_as_a)
from backends.wasm.kernels.conv_implicit_gemm import implicit_gemm_is_faster
from backends.wasm.kernels.operands import ConvOffsets
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
    w = pack_conv_weight(spec, w)
    layout, end = {}, 32
    for key, size in (("x", x.nbytes), ("w", w.nbytes), ("b", spec.out_channels * 4),
                      ("y", int(np.prod(y_shape)) * 4), ("r", int(np.prod(y_shape)) * 4),
                      ("scratch", conv_scratch_bytes(spec))):
        layout[key], end = end, end + size + 16
    at = ConvOffsets(layout["x"], layout["w"], layout["y"], layout["scratch"],
                     bias=layout["b"] if bias is not None else None,
                     residual=layout["r"] if residual is not None else None)
    funcs = render_conv2d(spec, at, epilogue=epilogue, features=features)
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
    # im2col's runs of in-image pixels: every stride the vector copy has a load form for (1 contiguous,
    # 2 and 3 shuffled, 4 lane by lane), rows that cross 16-pixel panel boundaries at every offset
    # (widths 23, 37), rows narrower than one v128 (widths 1-3), padding on one side only
    "stride1-odd-width-crosses-panels": Conv2dSpec(1, 3, 7, 23, 5, (3, 3), pads=(1, 1, 1, 1)),
    "stride2-crosses-panels": Conv2dSpec(1, 2, 13, 75, 6, (3, 3), strides=(2, 2), pads=(0, 1, 1, 0)),
    "stride3-asymmetric-pads": Conv2dSpec(1, 3, 16, 47, 4, (5, 4), strides=(3, 3), pads=(2, 0, 1, 3)),
    "stride4-11x11-alexnet-like": Conv2dSpec(1, 3, 47, 51, 8, (11, 11), strides=(4, 4), pads=(2, 2, 2, 2)),
    "stride2-dilated-grouped": Conv2dSpec(1, 4, 21, 29, 6, (3, 3), strides=(2, 2), pads=(2, 2, 2, 2),
                                          dilations=(2, 2), groups=2),
    "width-1": Conv2dSpec(1, 2, 9, 1, 3, (3, 1), pads=(1, 0, 1, 0)),
    "width-2-stride2": Conv2dSpec(1, 2, 9, 4, 3, (3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
    "width-3-wider-padding-than-image": Conv2dSpec(1, 3, 5, 3, 4, (3, 3), pads=(1, 3, 1, 2)),
    "stride3-horizontal-1-vertical": Conv2dSpec(1, 3, 10, 40, 4, (2, 3), strides=(1, 3)),
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


# im2col with the weight packed at compile time as the GEMM's A: two K blocks (k = 147), a short
# last row group, groups of 9 channels each, two row blocks of the GEMM (250 channels), two images
PACKED_A_SPECS = {
    **{name: SPECS[name] for name in ("3x3-pad1", "7x7-stride2-pad3", "pointwise", "stride2-crosses-panels",
                                      "dilated-asymmetric-pads", "stride4-11x11-alexnet-like")},
    "grouped-9-channels-each": Conv2dSpec(1, 8, 7, 9, 18, (3, 3), pads=(1, 1, 1, 1), groups=2),
    "250-channels": Conv2dSpec(1, 2, 6, 7, 250, (3, 3)),
    "batch-of-two-pointwise-grouped": Conv2dSpec(2, 6, 5, 5, 15, (1, 1), groups=3),
}


@pytest.mark.parametrize("features", [SIMD_FMA, SIMD], ids=["relaxed-simd", "simd"])
@pytest.mark.parametrize("name", PACKED_A_SPECS)
def test_conv_with_the_weight_packed_as_a_matches_onnxruntime(name, features):
    spec = PACKED_A_SPECS[name]
    assert weight_packs_as_a(spec, features) and not weight_packs_as_a(spec, SCALAR)
    packed = Conv2dSpec(**{**spec.__dict__, "packed_a": True})
    x, w, bias, residual = _random_case(spec, len(name), with_residual=True)
    want = np.maximum(onnxruntime_conv(spec, x, w, bias) + residual, 0)
    got = run_conv(packed, x, w, bias, residual, "relu", features)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4 * np.sqrt(spec.gemm_k))
    wat = render_conv2d(packed, ConvOffsets(0, 0, 0, 0), features=features)
    assert "$pack_k" not in wat and conv_scratch_bytes(packed) < conv_scratch_bytes(spec)


# im2col in chunks of output rows (C_CHUNK_BYTES shrunk so that small images have several): a last
# chunk shorter than the others, chunks that end mid-panel or fill whole panels, strides and
# asymmetric pads, the residual, two images, A packed at compile time or at run time
CHUNKED_SPECS = {  # the spec, the rows whose C is C_CHUNK_BYTES, the rows a chunk has
    "3x3-pad1-last-chunk-shorter": (Conv2dSpec(1, 20, 23, 30, 24, (3, 3), pads=(1, 1, 1, 1)), 2, 2),
    "3x3-stride2-rounded-up-to-whole-panels": (Conv2dSpec(1, 24, 31, 40, 20, (3, 3), strides=(2, 2), pads=(0, 1, 1, 0)),
                                               2, 4),
    "5x5-rows-fill-panels-two-images": (Conv2dSpec(2, 8, 20, 16, 12, (5, 5), pads=(2, 2, 2, 2)), 1, 1),
}


@pytest.mark.parametrize("a_packed", [True, False], ids=["a-packed", "a-packed-at-run-time"])
@pytest.mark.parametrize("features", [SIMD_FMA, SIMD, SCALAR], ids=["relaxed-simd", "simd", "scalar"])
@pytest.mark.parametrize("name", CHUNKED_SPECS)
def test_im2col_in_chunks_of_output_rows_matches_onnxruntime(monkeypatch, name, features, a_packed):
    if a_packed and features == SCALAR:
        pytest.skip("the scalar kernel reads A in place")
    spec, target, rows = CHUNKED_SPECS[name]
    spec = Conv2dSpec(**{**spec.__dict__, "packed_a": a_packed})
    chunk_bytes = target * spec.out_channels * 4 * spec.out_width
    monkeypatch.setattr(conv, "C_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(gemm, "C_CHUNK_BYTES", chunk_bytes)
    assert im2col_chunk_rows(spec) == rows
    x, w, bias, residual = _random_case(spec, len(name), with_residual=True)
    want = np.maximum(onnxruntime_conv(spec, x, w, bias) + residual, 0)
    got = run_conv(spec, x, w, bias, residual, "relu", features)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4 * np.sqrt(spec.gemm_k))
    assert f"in chunks of {rows} output rows" in render_conv2d(spec, ConvOffsets(0, 0, 0, 0), features=features)
    chunked = conv_scratch_bytes(spec)
    monkeypatch.setattr(conv, "C_CHUNK_BYTES", 1 << 40)
    assert im2col_chunk_rows(spec) is None and conv_scratch_bytes(spec) > chunked


def test_a_conv_with_four_channels_per_group_keeps_the_onnx_weight():
    """One 4-row tile reads A in place: nothing to pack, at compile time or at run time."""
    assert not weight_packs_as_a(SPECS["grouped"], SIMD_FMA)  # 12 channels in 4 groups
    with pytest.raises(ValueError, match="packed A"):
        Conv2dSpec(1, 6, 9, 9, 6, (3, 3), groups=6, packed_a=True)  # depthwise


def _check_residual_then_relu(spec: Conv2dSpec, features, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((spec.batch, spec.in_channels, spec.height, spec.width)).astype(np.float32)
    w = rng.standard_normal((spec.out_channels, spec.in_channels // spec.groups, *spec.kernel)).astype(np.float32)
    residual = rng.standard_normal((spec.batch, spec.out_channels, spec.out_height, spec.out_width)).astype(np.float32)
    want = np.maximum(onnxruntime_conv(spec, x, w, None) + residual, 0)
    got = run_conv(spec, x, w, None, residual, "relu", features)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_epilogue_adds_the_residual_then_applies_relu():
    _check_residual_then_relu(SPECS["3x3-pad1"], SIMD_FMA, seed=9)


def test_a_conv_with_no_output_pixels_is_refused():
    with pytest.raises(ValueError, match="empty"):
        Conv2dSpec(1, 3, 2, 2, 4, (5, 5))


@pytest.mark.parametrize("features", [SIMD_FMA, SCALAR], ids=["relaxed-simd", "scalar"])
def test_depthwise_conv_without_bias_adds_the_residual_then_applies_relu(features):
    _check_residual_then_relu(SPECS["depthwise-stride2"], features, seed=4)


def test_depthwise_conv_runs_directly_on_a_padded_plane_instead_of_im2col():
    spec = Conv2dSpec(1, 136, 28, 28, 136, (3, 3), pads=(1, 1, 1, 1), groups=136)  # ShuffleNet's
    assert conv_scratch_bytes(spec) == 30 * 30 * 4     # one zero-bordered plane, vs 9 x 136 x 784 floats
    wat = render_conv2d(spec, ConvOffsets(0, 0, 0, 0), features=SIMD_FMA)
    assert "im2col" not in wat and "depthwise" in wat


# The implicit GEMM: every kernel size the models use, strides, asymmetric padding, widths that
# leave 1-3 pixels at a row's end, output channels that leave a partial panel and a partial vector,
# more than one K block of channels, dilation, two images.
IMPLICIT_SPECS = {
    "1x1": Conv2dSpec(1, 16, 4, 8, 20, (1, 1), implicit_gemm=True),
    "1x1-odd-pixels-4-channels": Conv2dSpec(1, 5, 3, 7, 4, (1, 1), implicit_gemm=True),
    "1x1-stride2": Conv2dSpec(1, 24, 9, 11, 33, (1, 1), strides=(2, 2), implicit_gemm=True),
    "3x3-pad1-odd-width": Conv2dSpec(1, 3, 9, 11, 8, (3, 3), pads=(1, 1, 1, 1), implicit_gemm=True),
    "3x3-two-channel-blocks-partial-panel": Conv2dSpec(1, 130, 9, 13, 37, (3, 3), pads=(1, 1, 1, 1), implicit_gemm=True),
    "3x3-unpadded": Conv2dSpec(1, 6, 8, 10, 18, (3, 3), implicit_gemm=True),
    "3x3-stride2": Conv2dSpec(1, 8, 15, 14, 16, (3, 3), strides=(2, 2), pads=(1, 1, 1, 1), implicit_gemm=True),
    "5x5-stride2-asymmetric-pads": Conv2dSpec(1, 140, 9, 13, 35, (5, 5), strides=(2, 2), pads=(2, 1, 2, 2), implicit_gemm=True),
    "7x7-stride2-pad3": Conv2dSpec(1, 3, 20, 18, 16, (7, 7), strides=(2, 2), pads=(3, 3, 3, 3), implicit_gemm=True),
    "dilated-asymmetric-pads": Conv2dSpec(1, 4, 10, 12, 5, (3, 2), pads=(2, 0, 1, 1), dilations=(2, 3), implicit_gemm=True),
    "batch-of-two": Conv2dSpec(2, 17, 7, 7, 40, (3, 3), pads=(1, 1, 1, 1), implicit_gemm=True),
    # Y^T larger than one pixel group (Y_CHUNK_BYTES): 2 line rows of 652 pixels, the last shorter
    "pixel-groups": Conv2dSpec(1, 20, 40, 30, 100, (3, 3), pads=(1, 1, 1, 1), implicit_gemm=True),
    # strided: groups of 16 output rows, 13 rows left over
    "pixel-groups-stride2": Conv2dSpec(1, 8, 121, 61, 130, (3, 3), strides=(2, 2), pads=(1, 1, 1, 1), implicit_gemm=True),
}


def _random_case(spec, seed, with_bias=True, with_residual=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((spec.batch, spec.in_channels, spec.height, spec.width)).astype(np.float32)
    w = rng.standard_normal((spec.out_channels, spec.in_channels // spec.groups, *spec.kernel)).astype(np.float32)
    bias = rng.standard_normal(spec.out_channels).astype(np.float32) if with_bias else None
    shape = (spec.batch, spec.out_channels, spec.out_height, spec.out_width)
    residual = rng.standard_normal(shape).astype(np.float32) if with_residual else None
    return x, w, bias, residual


@pytest.mark.parametrize("features", [SIMD_FMA, SIMD], ids=["relaxed-simd", "simd"])
@pytest.mark.parametrize("name", IMPLICIT_SPECS)
def test_conv_as_implicit_gemm_matches_onnxruntime(name, features):
    spec = IMPLICIT_SPECS[name]
    x, w, bias, _ = _random_case(spec, len(name))
    want = onnxruntime_conv(spec, x, w, bias)
    got = run_conv(spec, x, w, bias, None, None, features)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4 * np.sqrt(spec.gemm_k))


@pytest.mark.parametrize("name", ["1x1-odd-pixels-4-channels", "3x3-two-channel-blocks-partial-panel",
                                  "5x5-stride2-asymmetric-pads", "batch-of-two"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_implicit_gemm_conv_adds_the_residual_then_applies_relu(name, with_bias):
    spec = IMPLICIT_SPECS[name]
    x, w, bias, residual = _random_case(spec, 7, with_bias, with_residual=True)
    want = np.maximum(onnxruntime_conv(spec, x, w, bias) + residual, 0)
    got = run_conv(spec, x, w, bias, residual, "relu", SIMD_FMA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4 * np.sqrt(spec.gemm_k))


def test_implicit_gemm_conv_applies_relu_in_its_epilogue():
    spec = IMPLICIT_SPECS["3x3-pad1-odd-width"]
    x, w, bias, _ = _random_case(spec, 11)
    got = run_conv(spec, x, w, bias, None, "relu", SIMD_FMA)
    want = np.maximum(onnxruntime_conv(spec, x, w, bias), 0)
    assert (got == 0).mean() > 0.2  # relu really clipped something
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_implicit_gemm_reads_a_compile_time_packed_weight_and_no_im2col():
    spec = IMPLICIT_SPECS["3x3-two-channel-blocks-partial-panel"]
    packed = pack_conv_weight(spec, np.zeros((37, 130, 3, 3), np.float32))
    assert packed.size == 3 * 16 * 130 * 9           # 37 channels -> 3 panels of 16, k = 9 x 130
    wat = render_conv2d(spec, ConvOffsets(0, 0, 0, 0), features=SIMD_FMA)
    assert "im2col" not in wat and "implicit GEMM" in wat


@pytest.mark.parametrize("name,calls", [("3x3-pad1-odd-width", ["conv_k"]),
                                        ("3x3-two-channel-blocks-partial-panel", ["conv_k", "conv_k_41"]),
                                        ("3x3-stride2", [])])
def test_implicit_gemm_tiles_call_the_gemm_k_functions_with_relaxed_simd_and_stride_1(name, calls):
    """The 4-pixel passes of a stride-1 Conv read A as one v128 per k step, as packed A in the GEMM,
    so they call its unrolled k functions (one per edge width); strided tiles keep the inline loop."""
    spec = IMPLICIT_SPECS[name]
    wat = render_conv2d(spec, ConvOffsets(0, 0, 0, 0), features=SIMD_FMA)
    called = sorted({c.split()[0][1:].rsplit("_", 1)[0] for c in wat.split("(call ")[1:] if "_zero" in c.split()[0] or "_acc" in c.split()[0]})
    assert called == calls
    for function in calls:
        assert f"(func ${function}_acc " in wat
    assert "_k_acc" not in render_conv2d(spec, ConvOffsets(0, 0, 0, 0), features=SIMD)


@pytest.mark.parametrize("spec,faster", [
    (Conv2dSpec(1, 128, 56, 56, 32, (3, 3), pads=(1, 1, 1, 1)), True),     # densenet121's dense-layer 3x3
    (Conv2dSpec(1, 64, 55, 55, 16, (1, 1)), True),                         # squeezenet's squeeze
    (Conv2dSpec(1, 480, 13, 13, 64, (1, 1)), True),                        # inception_v1's, a small image
    (Conv2dSpec(1, 64, 224, 224, 64, (3, 3), pads=(1, 1, 1, 1)), True),    # vgg19's second
    (Conv2dSpec(1, 512, 7, 7, 128, (1, 1)), False),                        # 128 channels: a tie, left alone
    (Conv2dSpec(1, 256, 56, 56, 256, (3, 3), pads=(1, 1, 1, 1)), False),
    (Conv2dSpec(1, 32, 13, 13, 64, (5, 5), pads=(2, 2, 2, 2)), False),     # 4 of every 17 columns wasted
    (Conv2dSpec(1, 64, 56, 56, 64, (1, 1)), False),                        # a 1x1 on a large image, no squeeze
    (Conv2dSpec(1, 3, 224, 224, 64, (7, 7), strides=(2, 2), pads=(3, 3, 3, 3)), False),  # 3-channel stem
    (Conv2dSpec(1, 256, 56, 56, 512, (1, 1), strides=(2, 2)), False),      # strided
    (Conv2dSpec(1, 8, 6, 6, 12, (3, 3), pads=(1, 1, 1, 1), groups=4), False),
])
def test_the_implicit_gemm_is_chosen_where_it_was_measured_faster(spec, faster):
    assert implicit_gemm_is_faster(spec, SIMD_FMA) is faster
    assert not implicit_gemm_is_faster(spec, SCALAR)  # the tile needs SIMD128


def test_a_grouped_conv_cannot_be_an_implicit_gemm():
    with pytest.raises(ValueError, match="groups"):
        Conv2dSpec(1, 8, 6, 6, 12, (3, 3), groups=4, implicit_gemm=True)


def test_a_compiled_model_runs_its_few_channel_convs_as_implicit_gemms_and_matches_onnxruntime():
    """Through the compiler: the lowering packs the weight at compile time for the Convs the rule
    picks (3x3 32 -> 24 and 1x1 24 -> 16, stride 1) and keeps im2col for the strided one, whose
    weight it packs as the GEMM's A."""
    from backends.wasm.intrinsics import kernels as target_kernels
    from backends.wasm.options import parse_options
    from codegen.lower import lower_graph
    from ir.onnx_import import import_model
    from passes import optimize_pipeline, run_pipeline
    from wasm_cases import assert_matches_onnxruntime, make_model

    rng = np.random.default_rng(3)
    init = lambda name, *shape: onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("Conv", ["c2", "w3", "b3"], ["y"], kernel_shape=[3, 3], strides=[2, 2])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32, 11, 13])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [init("w1", 24, 32, 3, 3), init("b1", 24), init("w2", 16, 24, 1, 1), init("w3", 8, 16, 3, 3), init("b3", 8)])
    x = rng.standard_normal((2, 32, 11, 13)).astype(np.float32)
    assert_matches_onnxruntime(model, {"x": x}, configs=[("simd,bulk-memory", "2"), ("simd,bulk-memory,relaxed-simd", "3"),
                                                         ("", "2")], rtol=1e-4, atol=1e-3)
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    program = lower_graph(graph, target_kernels(parse_options(None, "simd", "2")))
    convs = [conv_kernel_spec(s.spec, frozenset({"simd"})) for k in program.kernels for s in k.body
             if getattr(s, "name", None) == "conv2d"]
    assert [c.implicit_gemm for c in convs] == [True, True, False]
    assert [c.packed_a for c in convs] == [False, False, True]  # 8 channels: two row tiles


def test_convs_sharing_one_weight_share_its_packed_panels():
    from backends.wasm.intrinsics import kernels as target_kernels
    from backends.wasm.options import parse_options
    from codegen.lower import lower_graph
    from ir.loops.program import WEIGHT
    from ir.onnx_import import import_model
    from passes import optimize_pipeline, run_pipeline
    from wasm_cases import make_model

    w = onnx.numpy_helper.from_array(np.ones((16, 16, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c1", "w"], ["y"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    program = lower_graph(graph, target_kernels(parse_options(None, "simd", "2")))
    assert [s.nbytes for s in program.storages if s.kind == WEIGHT] == [16 * 16 * 9 * 4]


def _compiled_kernels(model, features="simd"):
    from backends.wasm.intrinsics import kernels as target_kernels
    from backends.wasm.options import parse_options
    from codegen.lower import lower_graph
    from ir.onnx_import import import_model
    from passes import optimize_pipeline, run_pipeline
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return [k for k in lower_graph(graph, target_kernels(parse_options(None, features, "2"))).kernels if k.body]


@pytest.mark.parametrize("residual_first", [False, True], ids=["conv+residual", "residual+conv"])
@pytest.mark.parametrize("out_channels,group", [(24, 1), (80, 1), (16, 16)], ids=["implicit-gemm", "im2col", "depthwise"])
def test_a_residual_add_and_relu_after_a_conv_run_in_the_conv_kernel(out_channels, group, residual_first):
    """resnet50's block end: Conv(+bias) -> Add(shortcut) -> Relu is one kernel, the shortcut read by
    the Conv's epilogue (the implicit GEMM's transpose pass, im2col's GEMM, the depthwise loop)."""
    from wasm_cases import assert_matches_onnxruntime, make_model

    rng = np.random.default_rng(5)
    x, shortcut = (rng.standard_normal((1, 16, 9, 11)).astype(np.float32),
                   rng.standard_normal((1, out_channels, 9, 11)).astype(np.float32))
    init = lambda name, *shape: onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], group=group),
             helper.make_node("Add", ["s", "c"] if residual_first else ["c", "s"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
                               helper.make_tensor_value_info("s", TensorProto.FLOAT, list(shortcut.shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [init("w", out_channels, 16 // group, 3, 3), init("b", out_channels)])
    assert_matches_onnxruntime(model, {"x": x, "s": shortcut}, configs=[
        ("simd,bulk-memory", "2"), ("simd,bulk-memory,relaxed-simd", "3"), ("", "2")], rtol=1e-4, atol=1e-3)
    kernels = _compiled_kernels(model)
    assert [k.op_type for k in kernels] == ["Conv"]
    (conv,) = [s for s in kernels[0].body if getattr(s, "name", None) == "conv2d"]
    assert conv.operands.residual is not None and conv.spec.epilogue.residual
    assert conv_kernel_spec(conv.spec, frozenset({"simd"})).implicit_gemm == (out_channels == 24)


def test_a_conv_add_with_a_broadcast_operand_is_not_a_residual():
    """A per-pixel map broadcast over the channels is no residual: the Add stays a pass of its own."""
    from wasm_cases import assert_matches_onnxruntime, make_model

    rng = np.random.default_rng(6)
    x, plane = rng.standard_normal((1, 16, 9, 11)).astype(np.float32), rng.standard_normal((1, 1, 9, 11)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Add", ["c", "p"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
                               helper.make_tensor_value_info("p", TensorProto.FLOAT, list(plane.shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [onnx.numpy_helper.from_array(rng.standard_normal((24, 16, 3, 3)).astype(np.float32), "w")])
    assert_matches_onnxruntime(model, {"x": x, "p": plane}, configs=[("simd,bulk-memory", "2")], rtol=1e-4, atol=1e-3)
    assert sorted(k.op_type for k in _compiled_kernels(model)) == ["Add", "Conv"]


# (spec, IM2COL_WHOLE_BYTES, IM2COL_CHUNK_BYTES, rows): Convs whose output alone would not be cut
# into chunks, but whose packed B would not stay in L2
B_CHUNKED_SPECS = {
    # one K block (3 x 7 x 7 = 147): the 7x7 stride-2 stem's shape, scaled down
    "7x7-stride2-stem": (Conv2dSpec(1, 3, 40, 32, 8, (7, 7), strides=(2, 2), pads=(3, 3, 3, 3)), 64 << 10, 147 * 16 * 4 * 2, 2),
    # a 1x1 Conv: chunks of its im2col instead of `render_pack_b`; 12-pixel rows, so 4 rows fill 3 panels
    "pointwise-rows-of-12": (Conv2dSpec(1, 20, 16, 12, 72, (1, 1)), 8 << 10, 20 * 12 * 4 * 4, 4),
    "3x3-stride2-rows-of-6": (Conv2dSpec(1, 16, 24, 12, 12, (3, 3), strides=(2, 2), pads=(1, 1, 1, 1)), 16 << 10, 144 * 6 * 4 * 8, 8),
}


@pytest.mark.parametrize("features", [SIMD_FMA, SCALAR], ids=["relaxed-simd", "scalar"])
@pytest.mark.parametrize("name", B_CHUNKED_SPECS)
def test_an_im2col_larger_than_l2_runs_in_chunks_of_rows_and_matches_onnxruntime(monkeypatch, name, features):
    spec, whole, chunk, rows = B_CHUNKED_SPECS[name]
    spec = conv_kernel_spec(spec, features)
    monkeypatch.setattr(conv, "IM2COL_WHOLE_BYTES", whole)
    monkeypatch.setattr(conv, "IM2COL_CHUNK_BYTES", chunk)
    assert im2col_chunk_rows(spec) == rows
    x, w, bias, residual = _random_case(spec, len(name), with_residual=True)
    want = np.maximum(onnxruntime_conv(spec, x, w, bias) + residual, 0)
    got = run_conv(spec, x, w, bias, residual, "relu", features)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4 * np.sqrt(spec.gemm_k))
    assert f"in chunks of {rows} output rows" in render_conv2d(spec, ConvOffsets(0, 0, 0, 0), features=features)
    monkeypatch.setattr(conv, "IM2COL_WHOLE_BYTES", 1 << 40)
    assert im2col_chunk_rows(spec) is None
