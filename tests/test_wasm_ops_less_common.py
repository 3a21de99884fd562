"""Less common ops compiled to WebAssembly match onnxruntime: scalar parameters read at run time
once the output's shape is static (OneHot's depth, Range's start and delta, window sizes, the mel
filter bank), the ai.onnx.ml arithmetic ops, MaxPool's Indices output, Einsum with an ellipsis,
Col2Im, DeformConv, TensorScatter and STFT. tests/test_cuda_ops.py runs the same cases on cuda-sim."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from wasm_cases import CONFIGS, assert_matches_onnxruntime, make_model

rng = np.random.default_rng(1)
# scalar and SIMD128 builds; the remaining configurations add nothing these loops exercise
QUICK = [CONFIGS[0], CONFIGS[1]]


def vi(name, shape, dtype=T.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def model_of(op, feeds, out_shape, attrs=None, opset=17, out_dtype=T.FLOAT, domain="", inputs=None):
    """One node over graph inputs `feeds`, its output declared with `out_shape` (what a model
    whose parameters are inputs must state for the shape to be static)."""
    node = helper.make_node(op, inputs if inputs is not None else list(feeds), ["y"], domain=domain or None,
                            **(attrs or {}))
    graph_inputs = [vi(n, list(a.shape), helper.np_dtype_to_tensor_dtype(a.dtype)) for n, a in feeds.items()]
    model = make_model([node], graph_inputs, [vi("y", out_shape, out_dtype)], opset=opset)
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


@pytest.mark.parametrize("axis", [-1, 1])
def test_one_hot_with_a_depth_fed_at_run_time_matches_onnxruntime(axis):
    indices = np.array([[0, 3, -1], [7, -8, 9]], np.int64)    # negative ones wrap, 9 is out of range
    feeds = {"indices": indices, "depth": np.array(8.0, np.float32), "values": np.array([-2.0, 5.0], np.float32)}
    shape = [2, 3, 8] if axis == -1 else [2, 8, 3]
    assert_matches_onnxruntime(model_of("OneHot", feeds, shape, {"axis": axis}), feeds, QUICK)


@pytest.mark.parametrize("dtype, start, limit, delta", [(np.float32, 1.5, -4.0, -0.75), (np.int32, 10, 2, -3)])
def test_range_with_start_and_delta_fed_at_run_time_matches_onnxruntime(dtype, start, limit, delta):
    feeds = {k: np.array(v, dtype) for k, v in (("start", start), ("limit", limit), ("delta", delta))}
    length = int(np.ceil((limit - start) / delta))
    model = model_of("Range", feeds, [length], out_dtype=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), opset=11)
    assert_matches_onnxruntime(model, feeds, QUICK)


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
def test_window_functions_with_their_size_fed_at_run_time_match_onnxruntime(op, periodic):
    feeds = {"size": np.array(11, np.int64)}
    assert_matches_onnxruntime(model_of(op, feeds, [11], {"periodic": periodic}), feeds, QUICK, atol=1e-6)


def test_mel_weight_matrix_with_every_parameter_fed_at_run_time_matches_onnxruntime():
    feeds = {"num_mel_bins": np.array(6, np.int64), "dft_length": np.array(32, np.int64),
             "sample_rate": np.array(8000, np.int64), "lower_edge_hertz": np.array(40.0, np.float32),
             "upper_edge_hertz": np.array(3500.0, np.float32)}
    assert_matches_onnxruntime(model_of("MelWeightMatrix", feeds, [17, 6]), feeds, QUICK)


def test_binarizer_matches_onnxruntime():
    feeds = {"x": randn(3, 17)}
    model = model_of("Binarizer", feeds, [3, 17], {"threshold": 0.25}, domain="ai.onnx.ml")
    assert_matches_onnxruntime(model, feeds, QUICK)


@pytest.mark.parametrize("shape", [(3, 5), (2, 2, 6)])
def test_array_feature_extractor_with_run_time_indices_matches_onnxruntime(shape):
    feeds = {"x": randn(*shape), "indices": np.array([4, 0, 2, 2], np.int64)}
    model = model_of("ArrayFeatureExtractor", feeds, [*shape[:-1], 4], domain="ai.onnx.ml")
    assert_matches_onnxruntime(model, feeds, QUICK)


@pytest.mark.parametrize("attrs, out_shape", [
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, [2, 3, 4, 3]),
    ({"kernel_shape": [2, 2], "storage_order": 1, "dilations": [2, 1]}, [2, 3, 5, 5]),
    ({"kernel_shape": [3, 2], "ceil_mode": 1, "strides": [2, 2]}, [2, 3, 3, 3]),
])
def test_max_pool_with_its_indices_output_matches_onnxruntime(attrs, out_shape):
    x = randn(2, 3, 7, 6)
    x[0, 0, :2, :2] = 1.0      # a tie: the first maximum's position is reported
    node = helper.make_node("MaxPool", ["x"], ["y", "indices"], **attrs)
    model = make_model([node], [vi("x", [2, 3, 7, 6])], [vi("y", out_shape), vi("indices", out_shape, T.INT64)],
                       opset=12)
    assert_matches_onnxruntime(model, {"x": x}, QUICK)


@pytest.mark.parametrize("equation, shapes", [
    ("...ii->...i", [(2, 3, 4, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (1, 4, 5)]),      # the ellipsis broadcasts (2,) with (1,)
    ("b...,...c", [(2, 3), (3, 4)]),                     # implicit output: the ellipsis first
])
def test_einsum_with_an_ellipsis_matches_onnxruntime(equation, shapes):
    feeds = {f"x{i}": randn(*s) for i, s in enumerate(shapes)}
    node = helper.make_node("Einsum", list(feeds), ["y"], equation=equation)
    inputs = [vi(n, list(a.shape)) for n, a in feeds.items()]
    model = make_model([node], inputs, [helper.make_empty_tensor_value_info("y")], opset=12)
    assert_matches_onnxruntime(model, feeds, QUICK)


@pytest.mark.parametrize("attrs", [{}, {"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}])
def test_col2im_matches_onnxruntime(attrs):
    image, block = [5, 6], [2, 3]
    strides, dilations = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    pads = attrs.get("pads", [0, 0, 0, 0])
    grid = [(n + pads[a] + pads[2 + a] - (d * (k - 1) + 1)) // s + 1
            for a, (n, k, s, d) in enumerate(zip(image, block, strides, dilations))]
    x = randn(2, 3 * 6, grid[0] * grid[1])
    node = helper.make_node("Col2Im", ["x", "image_shape", "block_shape"], ["y"], **attrs)
    params = [helper.make_tensor("image_shape", T.INT64, [2], image), helper.make_tensor("block_shape", T.INT64, [2], block)]
    model = make_model([node], [vi("x", list(x.shape))], [vi("y", [2, 3, *image])], params, opset=18)
    assert_matches_onnxruntime(model, {"x": x}, QUICK)


@pytest.mark.parametrize("with_mask_and_bias", [False, True])
def test_deform_conv_matches_onnxruntime(with_mask_and_bias):
    x, w = randn(1, 4, 5, 6), randn(6, 2, 2, 3)          # group 2, offset_group 2
    attrs = {"group": 2, "offset_group": 2, "pads": [1, 0, 1, 1], "strides": [2, 1], "kernel_shape": [2, 3]}
    out_h, out_w = (5 + 2 - 2) // 2 + 1, (6 + 1 - 3) // 1 + 1
    feeds = {"x": x, "w": w, "offset": randn(1, 2 * 6 * 2, out_h, out_w) * 1.5}
    names = ["x", "w", "offset"]
    if with_mask_and_bias:
        feeds.update({"b": randn(6), "mask": rng.uniform(0, 1, (1, 2 * 6, out_h, out_w)).astype(np.float32)})
        names += ["b", "mask"]
    model = model_of("DeformConv", feeds, [1, 6, out_h, out_w], attrs, opset=19, inputs=names)
    assert_matches_onnxruntime(model, feeds, QUICK)


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_with_run_time_write_indices_matches_onnxruntime(mode):
    feeds = {"cache": randn(3, 2, 6, 4), "update": randn(3, 2, 3, 4),
             "write_indices": np.array([0, 3, 5 if mode == "circular" else 2], np.int64)}
    model = model_of("TensorScatter", feeds, [3, 2, 6, 4], {"mode": mode}, opset=24)
    assert_matches_onnxruntime(model, feeds, QUICK)


@pytest.mark.parametrize("signal_shape, window, frame_length, onesided", [
    ((2, 200, 1), "hann", None, None),          # torch.stft's window, the default one-sided bins
    ((1, 150), None, 24, 1),                    # a real signal as [batch, samples], as torch exports it
    ((1, 90, 2), "ones", 16, 0),                # complex input, every bin
])
def test_stft_matches_onnxruntime(signal_shape, window, frame_length, onesided):
    """STFT as one GEMM of the windowed frames by the DFT's matrix, the window read at run time."""
    feeds = {"signal": randn(*signal_shape)}
    if window is not None:
        length = frame_length or 32
        feeds["window"] = (np.hanning(length + 1)[:-1] if window == "hann" else np.ones(length)).astype(np.float32)
    step = numpy_helper.from_array(np.array(10, np.int64), "frame_step")
    inits = [step] + ([numpy_helper.from_array(np.array(frame_length, np.int64), "frame_length")] if frame_length else [])
    inputs = ["signal", "frame_step", "window" if window is not None else "", "frame_length" if frame_length else ""]
    attrs = {} if onesided is None else {"onesided": onesided}
    node = helper.make_node("STFT", [name for name in inputs[:max(i + 1 for i, n in enumerate(inputs) if n)]], ["y"],
                            **attrs)
    graph_inputs = [vi(n, list(a.shape)) for n, a in feeds.items()]
    model = make_model([node], graph_inputs, [vi("y", None)], inits)
    assert_matches_onnxruntime(model, feeds, QUICK, rtol=1e-4, atol=1e-4)
