"""onnxruntime's quantized contrib ops (com.microsoft), expanded into standard ops, match onnxruntime's
own kernels end to end: one-node models per op (uint8 / int8, per tensor / per column, optional
inputs absent or present) and the quantizer's real outputs (samples/contrib_models.py,
samples/quantized_models.py), through decompose -> build-dag -> compile-wasm -> cortex.load, a few
on cuda-sim.

Integer outputs are equal, except where a float op decides a rounding: QLinearAveragePool and
QLinearSoftmax sum floats in another order than onnxruntime's loops, so a value that lies on a half
may round the other way (one quantum). Float outputs of the integer products are exact integers
times the same float scales: equal up to float rounding.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cortex
from backends.cuda import toolchain as cuda_compile
from cli_helpers import assert_one_line_error, build_and_run, first_failure, run_cli
from cuda_cases import run_cuda_sim
from samples import contrib_models as contrib
from samples import quantized_models as quantized
from samples.minilm import ensure_minilm
from testdata import run_onnxruntime
from wasm_cases import compile_pipeline

RNG = np.random.default_rng(7)
DOMAIN = "com.microsoft"
ONE_QUANTUM = {"QLinearAveragePool", "QLinearSoftmax"}     # float sums decide a rounding (see above)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def u8(*shape):
    return RNG.integers(0, 256, shape, dtype=np.uint8)


def i8(*shape):
    return RNG.integers(-128, 128, shape, dtype=np.int8)


def scale(value):
    return np.array(value, np.float32)


def zero(value, dtype):
    return np.array(value, dtype)


def node_model(op: str, feeds: dict, constants: dict, order: list[str], outputs=("out",), **attrs) -> onnx.ModelProto:
    """One com.microsoft node reading `order` (feeds, then constants by name; '' for an absent input)."""
    node = helper.make_node(op, order, list(outputs), name=op.lower(), domain=DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                     for k, v in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in outputs], [numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


def run_on_wasm(model: onnx.ModelProto, feeds: dict, tmp_path, input_shapes=None, dims=None) -> dict:
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    dag = compile_pipeline(path, tmp_path, input_shapes=input_shapes, dims=dims, min_cu_size=1)
    return cortex.load(dag, device="wasm").run(feeds)


def assert_quantized_close(got: dict, want: dict, quanta: int = 0, rtol: float = 1e-6, atol: float = 1e-6):
    assert sorted(got) == sorted(want)
    for name, expected in want.items():
        actual = got[name]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        if np.issubdtype(expected.dtype, np.integer):
            off = np.abs(actual.astype(np.int32) - expected.astype(np.int32))
            assert off.max() <= quanta, f"{name}: {int((off > 0).sum())} of {off.size} differ, by up to {off.max()}"
        else:
            np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=name)


# -- one node per case -------------------------------------------------------------------------
QGEMM_U8 = {"as": scale(0.03), "az": zero(5, np.uint8), "b": i8(8, 16), "bs": scale(0.02), "bz": zero(0, np.int8)}
QGEMM_I8 = {"as": scale(0.03), "az": zero(-3, np.int8), "b": i8(16, 8), "bs": np.abs(f32(8)) * 0.02 + 0.005,
            "bz": np.zeros(8, np.int8)}
LOOKUP_U8 = {"xs": scale(0.05), "xz": zero(3, np.uint8), "ys": scale(1 / 256), "yz": zero(0, np.uint8)}
LOOKUP_I8 = {"xs": scale(0.05), "xz": zero(-3, np.int8), "ys": scale(0.02), "yz": zero(-10, np.int8)}
BINARY_U8 = {"as": scale(0.05), "az": zero(3, np.uint8), "bs": scale(0.04), "bz": zero(100, np.uint8),
             "cs": scale(0.08), "cz": zero(128, np.uint8)}
BINARY_I8 = {"as": scale(0.05), "az": zero(-3, np.int8), "bs": scale(0.025), "bz": zero(0, np.int8),
             "cs": scale(0.1), "cz": zero(5, np.int8)}
POOL_U8 = {"xs": scale(0.05), "xz": zero(3, np.uint8), "ys": scale(0.03), "yz": zero(5, np.uint8)}
POOL_I8 = {"xs": scale(0.05), "xz": zero(-3, np.int8), "ys": scale(0.03), "yz": zero(2, np.int8)}
SOFTMAX_U8 = {"xs": scale(0.05), "xz": zero(3, np.uint8), "ys": scale(1 / 256), "yz": zero(0, np.uint8)}
SOFTMAX_I8 = {"xs": scale(0.08), "xz": zero(3, np.int8), "ys": scale(1 / 256), "yz": zero(-128, np.int8)}
WHERE_Q = {"xs": scale(0.05), "xz": zero(3, np.uint8), "ys": scale(0.07), "yz": zero(9, np.uint8), "zs": scale(0.06),
           "zz": zero(4, np.uint8)}

# name -> (op, feeds, constants, input order, attributes)
CASES = {
    "DynamicQuantizeMatMul-int8-bias": ("DynamicQuantizeMatMul", {"a": f32(3, 16)},
                                        {"b": i8(16, 8), "bs": scale(0.02), "bz": zero(0, np.int8), "bias": f32(8)},
                                        ["a", "b", "bs", "bz", "bias"], {}),
    "DynamicQuantizeMatMul-uint8-per-column-3d": ("DynamicQuantizeMatMul", {"a": f32(2, 3, 16)},
                                                  {"b": u8(16, 8), "bs": np.abs(f32(8)) * 0.01 + 0.001, "bz": u8(8)},
                                                  ["a", "b", "bs", "bz"], {}),
    "DynamicQuantizeMatMul-no-zero-point": ("DynamicQuantizeMatMul", {"a": f32(4, 16)},
                                            {"b": i8(16, 5), "bs": np.abs(f32(5)) * 0.01 + 0.001, "bias": f32(5)},
                                            ["a", "b", "bs", "", "bias"], {}),
    "MatMulIntegerToFloat-uint8-a-zero-bias": ("MatMulIntegerToFloat", {"a": u8(4, 16)},
                                               {"b": i8(16, 8), "as": scale(0.03), "bs": scale(0.02),
                                                "az": zero(7, np.uint8), "bias": f32(8)},
                                               ["a", "b", "as", "bs", "az", "", "bias"], {}),
    "MatMulIntegerToFloat-int8-per-column": ("MatMulIntegerToFloat", {"a": i8(2, 4, 16)},
                                             {"b": i8(16, 8), "as": scale(0.03), "bs": np.abs(f32(8)) * 0.02 + 0.001,
                                              "az": zero(-2, np.int8), "bz": np.zeros(8, np.int8)},
                                             ["a", "b", "as", "bs", "az", "bz"], {}),
    "MatMulIntegerToFloat-no-zero-points": ("MatMulIntegerToFloat", {"a": u8(4, 16)},
                                            {"b": u8(16, 8), "as": scale(0.03), "bs": scale(0.02)},
                                            ["a", "b", "as", "bs"], {}),
    "QGemm-float-output-bias-alpha": ("QGemm", {"a": u8(4, 16)},
                                      {**QGEMM_U8, "c": RNG.integers(-500, 500, 8, dtype=np.int32)},
                                      ["a", "as", "az", "b", "bs", "bz", "c"], {"transB": 1, "alpha": 0.5}),
    "QGemm-requantized-no-bias": ("QGemm", {"a": u8(4, 16)}, {**QGEMM_U8, "ys": scale(0.6), "yz": zero(128, np.uint8)},
                                  ["a", "as", "az", "b", "bs", "bz", "", "ys", "yz"], {"transB": 1}),
    "QGemm-int8-per-column-bias-transA": ("QGemm", {"a": i8(16, 4)},
                                          {**QGEMM_I8, "c": RNG.integers(-500, 500, (1, 8), dtype=np.int32),
                                           "ys": scale(0.5), "yz": zero(-5, np.int8)},
                                          ["a", "as", "az", "b", "bs", "bz", "c", "ys", "yz"], {"transA": 1}),
    "QLinearSigmoid-uint8": ("QLinearSigmoid", {"x": u8(2, 3, 4)}, LOOKUP_U8, ["x", "xs", "xz", "ys", "yz"], {}),
    "QLinearSigmoid-int8-no-x-zero-point": ("QLinearSigmoid", {"x": i8(2, 3, 4)},
                                            {"xs": scale(0.05), "ys": scale(1 / 256), "yz": zero(-128, np.int8)},
                                            ["x", "xs", "", "ys", "yz"], {}),
    "QLinearLeakyRelu-int8": ("QLinearLeakyRelu", {"x": i8(3, 5)}, LOOKUP_I8, ["x", "xs", "xz", "ys", "yz"],
                              {"alpha": 0.1}),
    "QLinearLeakyRelu-uint8": ("QLinearLeakyRelu", {"x": u8(3, 5)}, {**LOOKUP_U8, "ys": scale(0.04),
                                                                     "yz": zero(60, np.uint8)},
                               ["x", "xs", "xz", "ys", "yz"], {"alpha": 0.2}),
    "QLinearAdd-uint8-broadcast": ("QLinearAdd", {"a": u8(2, 3, 4), "b": u8(3, 4)}, BINARY_U8,
                                   ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], {}),
    "QLinearAdd-int8-constant-scalar": ("QLinearAdd", {"a": i8(2, 6)}, {**BINARY_I8, "b": np.array([40], np.int8)},
                                        ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], {}),
    "QLinearAdd-uint8-constant-scalar-first": ("QLinearAdd", {"b": u8(5, 4)}, {**BINARY_U8, "a": np.array(200, np.uint8)},
                                               ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], {}),
    "QLinearMul-uint8-broadcast": ("QLinearMul", {"a": u8(2, 3, 4), "b": u8(4)}, BINARY_U8,
                                   ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], {}),
    "QLinearMul-int8": ("QLinearMul", {"a": i8(3, 4), "b": i8(3, 4)}, BINARY_I8,
                        ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], {}),
    "QLinearGlobalAveragePool-uint8-nchw": ("QLinearGlobalAveragePool", {"x": u8(2, 4, 5, 6)}, POOL_U8,
                                            ["x", "xs", "xz", "ys", "yz"], {"channels_last": 0}),
    "QLinearGlobalAveragePool-int8-nhwc": ("QLinearGlobalAveragePool", {"x": i8(1, 5, 6, 4)}, POOL_I8,
                                           ["x", "xs", "xz", "ys", "yz"], {"channels_last": 1}),
    "QLinearAveragePool-uint8-pads": ("QLinearAveragePool", {"x": u8(1, 4, 7, 7)}, POOL_U8, ["x", "xs", "xz", "ys", "yz"],
                                      {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "QLinearAveragePool-int8-nhwc-count-pad-ceil": ("QLinearAveragePool", {"x": i8(1, 7, 7, 3)}, POOL_I8,
                                                    ["x", "xs", "xz", "ys", "yz"],
                                                    {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 0, 0],
                                                     "count_include_pad": 1, "ceil_mode": 1, "channels_last": 1}),
    "QLinearConcat-uint8": ("QLinearConcat", {"a": u8(2, 3), "b": u8(2, 5)},
                            {"ys": scale(0.05), "yz": zero(3, np.uint8), "as": scale(0.07), "az": zero(9, np.uint8)},
                            ["ys", "yz", "a", "as", "az", "b", "ys", "yz"], {"axis": 1}),
    "QLinearConcat-int8-three": ("QLinearConcat", {"a": i8(2, 3), "b": i8(1, 3), "c": i8(3, 3)},
                                 {"ys": scale(0.05), "yz": zero(3, np.int8), "as": scale(0.02), "az": zero(-9, np.int8),
                                  "cs": scale(0.11), "cz": zero(0, np.int8)},
                                 ["ys", "yz", "a", "as", "az", "b", "ys", "yz", "c", "cs", "cz"], {"axis": 0}),
    "QLinearSoftmax-uint8-last-axis": ("QLinearSoftmax", {"x": u8(3, 7)}, SOFTMAX_U8, ["x", "xs", "xz", "ys", "yz"],
                                       {"axis": -1, "opset": 13}),
    "QLinearSoftmax-int8-middle-axis": ("QLinearSoftmax", {"x": i8(2, 5, 3)}, SOFTMAX_I8,
                                        ["x", "xs", "xz", "ys", "yz"], {"axis": 1, "opset": 13}),
    "QLinearSoftmax-uint8-opset12": ("QLinearSoftmax", {"x": u8(2, 3, 4)}, SOFTMAX_U8, ["x", "xs", "xz", "ys", "yz"],
                                     {"axis": 1, "opset": 12}),
    "QLinearWhere-uint8-broadcast": ("QLinearWhere", {"c": RNG.random((2, 3)) > 0.5, "x": u8(2, 3), "y": u8(3)}, WHERE_Q,
                                     ["c", "x", "xs", "xz", "y", "ys", "yz", "zs", "zz"], {}),
    "QLinearWhere-uint8-x-as-output": ("QLinearWhere", {"c": RNG.random((4,)) > 0.5, "x": u8(4), "y": u8(4)}, WHERE_Q,
                                       ["c", "x", "zs", "zz", "y", "ys", "yz", "zs", "zz"], {}),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_one_node_matches_onnxruntime_on_wasm(case, tmp_path):
    op, feeds, constants, order, attrs = CASES[case]
    model = node_model(op, feeds, constants, order, **attrs)
    want = run_onnxruntime(model, feeds)
    got = run_on_wasm(model, feeds, tmp_path)
    assert_quantized_close(got, want, quanta=1 if op in ONE_QUANTUM else 0)
    if np.issubdtype(want["out"].dtype, np.integer):
        assert len(np.unique(want["out"])) > 2, "the case saturates: choose other scales"



@pytest.mark.parametrize("y_zero", [-128, 0, 50])
def test_qlinear_softmax_of_probability_one_saturates_at_127(y_zero, tmp_path):
    """A row with one unmasked score (the first row of a causal mask, scores masked with
    finfo.min: a huge X_scale) gives probability 1, i.e. 256 quanta above the zero point:
    onnxruntime clamps the int8 result to 127."""
    constants = {"xs": scale(1.3e36), "xz": zero(127, np.int8), "ys": scale(1 / 256), "yz": zero(y_zero, np.int8)}
    feeds = {"x": np.array([[127, -128, -128, -128], [127, 126, -128, -128], [5, 5, 5, 5]], np.int8)}
    model = node_model("QLinearSoftmax", feeds, constants, ["x", "xs", "xz", "ys", "yz"], axis=-1, opset=13)
    want = run_onnxruntime(model, feeds)
    assert want["out"][0, 0] == 127
    assert_quantized_close(run_on_wasm(model, feeds, tmp_path), want)


@pytest.mark.parametrize("byte", [np.int8, np.uint8], ids=["int8", "uint8"])
def test_qlinear_softmax_of_an_infinite_scale_gives_onnxruntime_s_zeros(byte, tmp_path):
    """Scores masked with -inf calibrate to X_scale = inf (onnxruntime's quantize_static on a torch
    attention block with a padding or causal mask): every row's sum is NaN and the kernel returns
    without writing, so onnxruntime's output is zeros, not the zero point."""
    constants = {"xs": scale(np.inf), "xz": zero(0, byte), "ys": scale(1 / 256),
                 "yz": zero(-128 if byte == np.int8 else 7, byte)}
    feeds = {"x": i8(2, 3, 5) if byte == np.int8 else u8(2, 3, 5)}
    model = node_model("QLinearSoftmax", feeds, constants, ["x", "xs", "xz", "ys", "yz"], axis=-1, opset=13)
    want = run_onnxruntime(model, feeds)
    assert not want["out"].any()
    assert_quantized_close(run_on_wasm(model, feeds, tmp_path), want)

# -- DynamicQuantizeLSTM --------------------------------------------------------------------------
def lstm_case(direction: str, per_channel: bool, weight_type):
    """onnxruntime's layout: W [directions, input, 4*hidden], R [directions, hidden, 4*hidden]."""
    directions, width, hidden = (2 if direction == "bidirectional" else 1), 3, 4
    info = np.iinfo(weight_type)
    w = RNG.integers(info.min, info.max + 1, (directions, width, 4 * hidden)).astype(weight_type)
    r = RNG.integers(info.min, info.max + 1, (directions, hidden, 4 * hidden)).astype(weight_type)
    shape = (directions, 4 * hidden) if per_channel else (directions,)
    w_scale, r_scale = np.abs(f32(*shape)) * 0.005 + 0.002, np.abs(f32(*shape)) * 0.005 + 0.002
    zp = np.zeros(shape, np.int8) if weight_type == np.int8 else np.full(shape, 128, np.uint8)
    constants = {"w": w, "r": r, "b": f32(directions, 8 * hidden) * 0.1, "ws": w_scale, "wz": zp, "rs": r_scale, "rz": zp}
    feeds = {"x": f32(5, 2, width), "h0": f32(directions, 2, hidden) * 0.5}
    order = ["x", "w", "r", "b", "", "h0", "", "", "ws", "wz", "rs", "rz"]
    model = node_model("DynamicQuantizeLSTM", feeds, constants, order, outputs=("out", "h", "c"), hidden_size=hidden,
                       direction=direction)
    dequantized = {"W": (w.astype(np.float32) - zp.reshape(directions, 1, -1)) * w_scale.reshape(directions, 1, -1),
                   "R": (r.astype(np.float32) - zp.reshape(directions, 1, -1)) * r_scale.reshape(directions, 1, -1)}
    float_node = helper.make_node("LSTM", ["x", "W", "R", "b", "", "h0"], ["out", "h", "c"], hidden_size=hidden,
                                  direction=direction)
    float_model = helper.make_model(helper.make_graph(
        [float_node], "lstm", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in ("out", "h", "c")],
        [numpy_helper.from_array(np.ascontiguousarray(v.transpose(0, 2, 1)), k) for k, v in dequantized.items()]
        + [numpy_helper.from_array(constants["b"], "b")]), opset_imports=[helper.make_opsetid("", 17)])
    return model, float_model, feeds


def through_uint8(x: np.ndarray) -> np.ndarray:
    """x quantized as DynamicQuantizeLinear quantizes it (range widened to hold 0), dequantized."""
    low, high = np.float32(min(x.min(), 0)), np.float32(max(x.max(), 0))
    scale = (high - low) / np.float32(255)
    zero = np.clip(np.round(-low / scale), 0, 255)
    return ((np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale).astype(np.float32)


@pytest.mark.parametrize("direction,per_channel,weight_type", [("forward", False, np.int8),
                                                                ("bidirectional", True, np.uint8)],
                         ids=["forward-int8-per-tensor", "bidirectional-uint8-per-channel"])
def test_dynamic_quantize_lstm_is_the_float_lstm_of_its_dequantized_weights_over_x_through_uint8(
        direction, per_channel, weight_type, tmp_path):
    """Cortex runs a float LSTM over the dequantized weights and X quantized to uint8 and back, as
    onnxruntime's kernel quantizes X for its input GEMM: it equals onnxruntime's float LSTM on
    them, and is no farther from onnxruntime's DynamicQuantizeLSTM than that float LSTM on X itself
    (the kernel also quantizes each step's hidden state: the rest of the difference)."""
    model, float_model, feeds = lstm_case(direction, per_channel, weight_type)
    got = run_on_wasm(model, feeds, tmp_path)
    exact = run_onnxruntime(float_model, {**feeds, "x": through_uint8(feeds["x"])})
    unquantized = run_onnxruntime(float_model, feeds)
    quantized_kernel = run_onnxruntime(model, feeds)
    for name in ("out", "h", "c"):
        np.testing.assert_allclose(got[name], exact[name], rtol=1e-4, atol=1e-5, err_msg=name)
        quantization_error = np.abs(unquantized[name] - quantized_kernel[name]).max()
        assert 0 < quantization_error < 0.05 * np.abs(exact[name]).max(), name
        assert np.abs(got[name] - quantized_kernel[name]).max() <= quantization_error + 1e-5, name


# -- the quantizer's models -----------------------------------------------------------------------
INTEGER_PRODUCTS = {"ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul"}


def with_quantized_outputs(path) -> onnx.ModelProto:
    """The model with every com.microsoft node's outputs, and the integer products', as graph outputs
    too, so that a model whose final output says little (the light models' weights are constants:
    their class scores are uniform) is still checked at every quantized op."""
    model = onnx.load(path)
    listed = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for node in model.graph.node
                              if node.domain == DOMAIN or node.op_type in INTEGER_PRODUCTS
                              for name in node.output if name and name not in listed)
    return model


CONTRIB = {"dynamic-quantize-matmul": contrib.quantized_matmul, "matmul-integer-to-float": contrib.quantized_shared_matmuls,
           "qoperator-net": contrib.quantized_qoperator_net}


@pytest.mark.parametrize("name", CONTRIB, ids=str)
def test_contrib_quantized_models_match_onnxruntime_on_wasm(name, tmp_path):
    sample = CONTRIB[name]()
    feeds = {k: RNG.standard_normal(shape).astype(np.float32) for k, shape in sample.input_shapes.items()}
    model = with_quantized_outputs(sample.path)
    got = run_on_wasm(model, feeds, tmp_path, input_shapes=sample.input_shapes)
    assert_quantized_close(got, run_onnxruntime(model, feeds), rtol=1e-5, atol=1e-5)


def test_contrib_quantized_lstm_is_within_the_activation_quantization_error(tmp_path):
    sample = contrib.quantized_lstm()
    feeds = {"x": RNG.standard_normal((5, 2, 4)).astype(np.float32)}
    got = run_on_wasm(onnx.load(sample.path), feeds, tmp_path, input_shapes=sample.input_shapes)
    want = run_onnxruntime(sample.path, feeds)
    for name, expected in want.items():
        # uint8 activations: X's step is its range / 255 (about 0.02 here), moving a gate by up
        # to the step times the weights' row sums; what remains is well below that.
        np.testing.assert_allclose(got[name], expected, atol=0.02, err_msg=name)


LIGHT = [(name, static) for name in quantized.LIGHT_NAMES for static in (False, True)]


@pytest.mark.parametrize("name,static", LIGHT, ids=[f"{n}-{'static' if s else 'dynamic'}" for n, s in LIGHT])
def test_quantized_light_models_match_onnxruntime_on_wasm(name, static, tmp_path):
    sample = quantized.quantized_light_model(name, static)
    model = with_quantized_outputs(sample.path)
    want = run_onnxruntime(model, sample.feed)
    got = run_on_wasm(model, sample.feed, tmp_path, input_shapes=sample.input_shapes)
    # the dynamic form's DynamicQuantizeLinear reads float convolutions: a last-ulp difference can
    # move an activation across a half, one quantum of its scale
    assert_quantized_close(got, want, rtol=1e-4, atol=1e-5 if static else 1e-3)
    if static:
        assert len(want) > 1


def test_quantized_minilm_static_matches_onnxruntime_on_wasm(tmp_path):
    """QLinearMatMul, QLinearAdd, QLinearMul, QLinearSoftmax between float LayerNormalization and
    Erf: an int8 tensor may move by one quantum where a float op's last ulp moves a QuantizeLinear
    across a half."""
    sample = quantized.quantized_minilm(static=True)
    model = with_quantized_outputs(sample.path)
    got = run_on_wasm(model, sample.feed, tmp_path, dims=sample.dims)
    assert_quantized_close(got, run_onnxruntime(model, sample.feed), quanta=1, rtol=1e-3, atol=1e-3)


def test_quantized_minilm_dynamic_matches_onnxruntime_on_wasm(tmp_path):
    """DynamicQuantizeLinear reads float LayerNormalization / Gelu outputs: a last-ulp difference can
    move one activation across a half, changing the products it feeds by one step of its scale. The
    tolerance is a twentieth of what quantization itself changes (quantized against float MiniLM)."""
    sample = quantized.quantized_minilm(static=False)
    got = run_on_wasm(onnx.load(sample.path), sample.feed, tmp_path, dims=sample.dims)
    want = run_onnxruntime(sample.path, sample.feed)["last_hidden_state"]
    float_model = run_onnxruntime(ensure_minilm(), sample.feed)["last_hidden_state"]
    quantization_error = np.abs(want - float_model).max()
    assert np.abs(got["last_hidden_state"] - want).max() <= quantization_error / 20
    assert np.abs(got["last_hidden_state"] - want).mean() <= 1e-3


# -- cuda-sim --------------------------------------------------------------------------------------
CUDA_CASES = ["QGemm-int8-per-column-bias-transA", "QLinearAdd-int8-constant-scalar", "QLinearSoftmax-int8-middle-axis",
              "DynamicQuantizeMatMul-uint8-per-column-3d"]


@pytest.mark.skipif(cuda_compile.find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_one_node_matches_onnxruntime_on_cuda_sim(case):
    op, feeds, constants, order, attrs = CASES[case]
    model = node_model(op, feeds, constants, order, **attrs)
    assert_quantized_close(run_cuda_sim(model, feeds), run_onnxruntime(model, feeds),
                           quanta=1 if op in ONE_QUANTUM else 0)


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("case", ["QLinearSoftmax-int8-middle-axis", "QLinearGlobalAveragePool-int8-nhwc",
                                  "QGemm-int8-per-column-bias-transA", "DynamicQuantizeMatMul-int8-bias"])
def test_bodies_hold_in_the_opsets_quantized_models_use(case, opset, tmp_path):
    """The bodies' ops are read at the model's opset (the quantizer keeps a model's own, 13 or more)."""
    op, feeds, constants, order, attrs = CASES[case]
    model = node_model(op, feeds, constants, order, **attrs)
    model.opset_import[0].version = opset
    assert_quantized_close(run_on_wasm(model, feeds, tmp_path), run_onnxruntime(model, feeds),
                           quanta=1 if op in ONE_QUANTUM else 0)


def test_a_missing_required_attribute_is_one_line_naming_the_node(tmp_path):
    op, feeds, constants, order, attrs = CASES["QLinearSoftmax-uint8-last-axis"]
    path = tmp_path / "model.onnx"
    onnx.save(node_model(op, feeds, constants, order, axis=-1), path)
    code, _, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "'qlinearsoftmax'", "QLinearSoftmax", "'opset'")


# -- MatMulNBits: weight-only block quantization ----------------------------------------------
def nbits_case(bits: int, k: int, n: int, block: int, zero_points: str | None = None, g_idx: bool = False,
               bias: bool = False, rows=(3,)):
    """(feeds, constants, input order, attributes) of a MatMulNBits node with random codes;
    `zero_points`: None, "packed" (uint8 bit fields, each row starting on a byte) or "float"."""
    blocks = -(-k // block)
    constants = {"b": RNG.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8),
                 "s": (RNG.random(n * blocks) * 0.1 + 0.01).astype(np.float32)}
    if zero_points == "packed":
        constants["zp"] = RNG.integers(0, 256, n * -(-blocks * bits // 8), dtype=np.uint8)
    elif zero_points == "float":
        constants["zp"] = (RNG.random(n * blocks) * (2 ** bits - 1)).astype(np.float32)
    if g_idx:
        constants["g"] = RNG.permutation(np.arange(k) // block).astype(np.int32)
    if bias:
        constants["bias"] = f32(n)
    order = ["a", "b", "s", "zp" if zero_points else "", "g" if g_idx else "", "bias" if bias else ""]
    while not order[-1]:
        order.pop()
    return {"a": f32(*rows, k)}, constants, order, {"K": k, "N": n, "bits": bits, "block_size": block}


NBITS_CASES = {
    "4-bit-symmetric": nbits_case(4, 64, 16, 32),
    "4-bit-packed-zero-points-k-not-a-multiple-3d-bias": nbits_case(4, 80, 8, 32, "packed", bias=True, rows=(2, 3)),
    "8-bit-packed-zero-points": nbits_case(8, 48, 8, 16, "packed"),
    "2-bit-packed-zero-points": nbits_case(2, 64, 8, 32, "packed"),
    "4-bit-float-zero-points": nbits_case(4, 64, 8, 16, "float"),
    "4-bit-g-idx-float-zero-points": nbits_case(4, 64, 8, 16, "float", g_idx=True),
    "4-bit-g-idx-no-zero-points": nbits_case(4, 64, 8, 16, g_idx=True),
}


@pytest.mark.parametrize("case", NBITS_CASES, ids=str)
def test_matmul_nbits_matches_onnxruntime_on_wasm(case, tmp_path):
    feeds, constants, order, attrs = NBITS_CASES[case]
    model = node_model("MatMulNBits", feeds, constants, order, **attrs)
    want = run_onnxruntime(model, feeds)
    got = run_on_wasm(model, feeds, tmp_path)
    assert_quantized_close(got, want, rtol=1e-5, atol=2e-5)
    assert np.abs(want["out"]).max() > 1.0     # codes and scales give outputs well away from 0


def test_matmul_nbits_quantizer_outputs_match_onnxruntime_on_wasm(tmp_path):
    """onnxruntime's int4 weight-only quantizer (symmetric and asymmetric) on a two-layer MLP."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 96])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 48])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [x], [y], [numpy_helper.from_array(f32(96, 64) * 0.2, "w1"),
                                                     numpy_helper.from_array(f32(64, 48) * 0.2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": f32(4, 96)}
    for symmetric in (True, False):
        quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=symmetric)
        quantizer.process()
        quantized = quantizer.model.model
        assert [n.op_type for n in quantized.graph.node].count("MatMulNBits") == 2
        folder = tmp_path / f"symmetric-{symmetric}"
        folder.mkdir()
        assert_quantized_close(run_on_wasm(quantized, feeds, folder), run_onnxruntime(quantized, feeds),
                               rtol=1e-5, atol=1e-5)


def test_matmul_nbits_with_g_idx_and_packed_zero_points_stays_for_a_fallback_cu(tmp_path):
    feeds, constants, order, attrs = nbits_case(4, 64, 8, 16, "packed", g_idx=True)
    path = tmp_path / "model.onnx"
    onnx.save(node_model("MatMulNBits", feeds, constants, order, **attrs), path)
    command, code, err = first_failure(path, tmp_path, "--min-cu-size", "1")
    assert command == "compile-wasm"
    assert_one_line_error(code, err, "MatMulNBits (matmulnbits: ", "g_idx", "float zero points", "--fallback onnxruntime")
    # The node stays as it is, so a fallback CU runs it on onnxruntime.
    (tmp_path / "fallback").mkdir()
    got = build_and_run(path, tmp_path / "fallback", feeds, "--min-cu-size", "1", "--fallback", "onnxruntime")
    np.testing.assert_array_equal(got["out"], run_onnxruntime(path, feeds)["out"])
