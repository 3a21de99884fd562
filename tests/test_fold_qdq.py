"""fold-qdq: QDQ graphs (onnxruntime's quantize_static, QuantFormat.QDQ) run as integer ops.

Each small graph is checked twice: which nodes the pipeline leaves (the integer op, or the float op
where folding must not happen), and Cortex's compiled WebAssembly against onnxruntime on the same
unfolded QDQ file with all graph optimisations on (onnxruntime folds QDQ groups too).

Tolerances: an int8 output may differ by one quantum, since onnxruntime computes a DQ -> MatMul ->
Q group it does not fuse as a float sum of dequantized products, rounded at the Q, while Cortex
rounds the exact int32 sum once; a float output of an integer product (MatMulInteger -> Mul) is the
exact integer sum times the scale, so it agrees to float32 rounding (rtol 1e-6).
"""

from __future__ import annotations

import collections
import glob
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import cortex
from backends.cuda.toolchain import find_nvcc
from cli_helpers import run_cli
from cuda_cases import compile_cuda_pipeline
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from samples.qdq_models import qdq_minilm, qdq_net, qdq_squeezenet
from cortex.tools.exact_u8s8 import reference_source
from wasm_cases import compile_pipeline, run_wasm

S8, U8 = TensorProto.INT8, TensorProto.UINT8
RNG = np.random.default_rng(0)


def onnxruntime_outputs(model, feeds) -> list[np.ndarray]:
    """onnxruntime's outputs with its optimisations on (it fuses the QDQ pairs into integer kernels);
    uint8 x int8 products exact on every machine (cortex/tools/exact_u8s8.py)."""
    data, feeds, _ = reference_source(model, feeds)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def folded_ops(model, input_shapes=None, dims=None) -> list[str]:
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(input_shapes, dims, require_static=True))
    return [n.op_type for n in graph.nodes]


def const(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def quantized_weight(name, shape, dtype=S8, axis=None):
    """(int8 weight, scale, zero point) initializers, per tensor or along `axis`."""
    w = RNG.standard_normal(shape).astype(np.float32)
    if axis is None:
        scale = np.float32(np.abs(w).max() / 127)
    else:
        scale = (np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != axis)) / 127).astype(np.float32)
        scale = scale.reshape(-1)
    shaped = scale if axis is None else scale.reshape([-1 if i == axis else 1 for i in range(w.ndim)])
    if dtype == S8:
        q, zero = np.clip(np.rint(w / shaped), -127, 127).astype(np.int8), np.zeros_like(scale, np.int8)
    else:
        q, zero = np.clip(np.rint(w / shaped) + 128, 0, 255).astype(np.uint8), np.full_like(scale, 128, np.uint8)
    return [const(name + "_q", q), const(name + "_scale", scale), const(name + "_zero", zero)]


def dq(value, out, axis=None):
    attrs = {} if axis is None else {"axis": axis}
    return helper.make_node("DequantizeLinear", [value + "_q", value + "_scale", value + "_zero"], [out], **attrs)


def activation_params(name, scale, zero, dtype=S8):
    np_type = np.int8 if dtype == S8 else np.uint8
    return [const(name + "_scale", np.float32(scale)), const(name + "_zero", np.array(zero, np_type))]


def model_of(nodes, inputs, outputs, initializers, opset=19):
    graph = helper.make_graph(nodes, "qdq", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def qdq_matmul(per_channel=False, float_output=False, act=S8, weight=S8, shared_weight=False,
               float_reader_of_x=False, x_scale_input=False):
    """x -> Q -> DQ -> MatMul(DQ(w)) [-> Q -> output y_q] (or the float product as output)."""
    k, n = 24, 10
    inits = quantized_weight("w", (k, n), weight, 1 if per_channel else None)
    inits += activation_params("y", 0.3, 3, act)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])]
    if x_scale_input:
        inputs.append(helper.make_tensor_value_info("x_scale", TensorProto.FLOAT, []))
        inits.append(const("x_zero", np.array(0 if act == S8 else 128, np.int8 if act == S8 else np.uint8)))
    else:
        inits += activation_params("x", 0.02, 0 if act == S8 else 128, act)
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]), dq("x", "x_dq"),
             dq("w", "w_dq", 1 if per_channel else None), helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"])]
    out_type = TensorProto.FLOAT if float_output else act
    outputs = [helper.make_tensor_value_info("y" if float_output else "y_q", out_type, [4, n])]
    if not float_output:
        nodes.append(helper.make_node("QuantizeLinear", ["y", "y_scale", "y_zero"], ["y_q"]))
    if shared_weight:   # the float weight also read by a float op
        nodes.append(helper.make_node("ReduceSum", ["w_dq"], ["w_sum"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("w_sum", TensorProto.FLOAT, []))
    if float_reader_of_x:
        nodes.append(helper.make_node("Relu", ["x_dq"], ["x_relu"]))
        outputs.append(helper.make_tensor_value_info("x_relu", TensorProto.FLOAT, [4, k]))
    return model_of(nodes, inputs, outputs, inits)


def feeds_for(model, **extra):
    x = RNG.standard_normal((4, 24)).astype(np.float32)
    return {"x": x, **extra}


def assert_within_one_quantum(got, want):
    assert got.dtype == want.dtype
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1, diff.max()
    assert (diff == 0).mean() > 0.9          # a boundary case now and then, not a systematic offset


def check_against_onnxruntime(model, feeds):
    want = onnxruntime_outputs(model, feeds)
    got = run_wasm(model, feeds)
    names = [o.name for o in model.graph.output]
    for name, w in zip(names, want):
        if w.dtype == np.float32:
            np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=1e-6 * np.abs(w).max(), err_msg=name)
        else:
            assert_within_one_quantum(got[name], w)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("act,weight", [(S8, S8), (U8, S8), (U8, U8)], ids=["s8s8", "u8s8", "u8u8"])
def test_matmul_then_q_becomes_qlinear_matmul(per_channel, act, weight):
    model = qdq_matmul(per_channel, act=act, weight=weight)
    assert folded_ops(model) == ["QuantizeLinear", "QLinearMatMul"]
    check_against_onnxruntime(model, feeds_for(model))


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_matmul_with_a_float_reader_becomes_matmul_integer_and_a_scale(per_channel):
    model = qdq_matmul(per_channel, float_output=True)
    assert folded_ops(model) == ["QuantizeLinear", "MatMulInteger", "Cast", "Mul"]
    check_against_onnxruntime(model, feeds_for(model))


def test_an_activation_dequantize_read_as_float_elsewhere_stays_for_that_reader():
    model = qdq_matmul(float_reader_of_x=True)
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    ops = [n.op_type for n in graph.nodes]
    assert "QLinearMatMul" in ops and "MatMul" not in ops
    (dq_node,) = [n for n in graph.nodes if n.op_type == "DequantizeLinear"]
    assert [n.op_type for n in graph.nodes if dq_node.outputs[0] in n.inputs] == ["Relu"]
    check_against_onnxruntime(model, feeds_for(model))


@pytest.mark.parametrize("case", ["weight read as float elsewhere", "non-constant scale", "s8 activation, u8 weight"])
def test_groups_onnxruntime_would_not_fold_stay_float(case):
    extra = {}
    if case == "weight read as float elsewhere":
        model = qdq_matmul(shared_weight=True)
    elif case == "non-constant scale":
        model = qdq_matmul(x_scale_input=True)
        extra = {"x_scale": np.array(0.02, np.float32)}
    else:
        model = qdq_matmul(act=S8, weight=U8)
    ops = folded_ops(model)
    assert "MatMul" in ops and not {"QLinearMatMul", "MatMulInteger"} & set(ops), ops
    # The float MatMul of dequantized values is what onnxruntime runs too: one quantum at most.
    check_against_onnxruntime(model, feeds_for(model, **extra))


def test_a_per_axis_activation_is_not_folded():
    k, n = 6, 5
    inits = quantized_weight("w", (k, n)) + activation_params("y", 0.2, 0)
    inits += [const("x_scale", np.linspace(0.01, 0.03, k).astype(np.float32)), const("x_zero", np.zeros(k, np.int8))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"], axis=1), dq("x", "x_dq", 1),
             dq("w", "w_dq"), helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"]),
             helper.make_node("QuantizeLinear", ["y", "y_scale", "y_zero"], ["y_q"])]
    model = model_of(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                     [helper.make_tensor_value_info("y_q", S8, [k, n])], inits)
    assert folded_ops(model) == ["QuantizeLinear", "DequantizeLinear", "MatMul", "QuantizeLinear"]
    check_against_onnxruntime(model, {"x": RNG.standard_normal((k, k)).astype(np.float32)})


def qdq_conv(per_channel=False, relu=False, act=S8, y_zero=None):
    m, c = 6, 3
    axis = 0 if per_channel else None
    inits = quantized_weight("w", (m, c, 3, 3), S8, axis)
    inits += activation_params("x", 0.02, 0 if act == S8 else 128, act)
    if y_zero is None:     # with a Relu, the type's minimum: the Q then clamps at 0 as the Relu does
        y_zero = (-128 if act == S8 else 0) if relu else (0 if act == S8 else 128)
    inits += activation_params("y", 0.05, y_zero, act)
    w_scale = numpy_helper.to_array(inits[1]).astype(np.float32)
    bias_scale = (np.float32(0.02) * w_scale).reshape(-1)
    inits += [const("b_q", RNG.integers(-500, 500, m).astype(np.int32)),
              const("b_scale", bias_scale if per_channel else bias_scale.reshape(())),
              const("b_zero", np.zeros(m if per_channel else (), np.int32))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]), dq("x", "x_dq"),
             dq("w", "w_dq", axis), dq("b", "b_dq", axis),
             helper.make_node("Conv", ["x_dq", "w_dq", "b_dq"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2])]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
    nodes.append(helper.make_node("QuantizeLinear", ["r" if relu else "c", "y_scale", "y_zero"], ["y_q"]))
    return model_of(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 9, 9])],
                    [helper.make_tensor_value_info("y_q", act, [1, m, 5, 5])], inits)


@pytest.mark.parametrize("per_channel,relu,act", [(False, False, S8), (True, False, S8), (True, True, S8),
                                                   (False, True, U8)],
                         ids=["per-tensor", "per-channel", "per-channel-relu", "u8-relu"])
def test_conv_with_int32_bias_then_q_becomes_qlinear_conv(per_channel, relu, act):
    model = qdq_conv(per_channel, relu, act)
    assert folded_ops(model) == ["QuantizeLinear", "QLinearConv"]
    check_against_onnxruntime(model, {"x": RNG.standard_normal((1, 3, 9, 9)).astype(np.float32)})


def in_contrib_domain(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same Q/DQ as com.microsoft ops, as the quantizer writes them with UseQDQContribOps."""
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            node.domain = "com.microsoft"
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_contrib_domain_quantize_and_dequantize_fold_like_the_standard_ones():
    model = in_contrib_domain(qdq_conv(per_channel=True))
    assert folded_ops(model) == ["QuantizeLinear", "QLinearConv"]
    check_against_onnxruntime(model, {"x": RNG.standard_normal((1, 3, 9, 9)).astype(np.float32)})


def test_sixteen_bit_contrib_qdq_runs_as_float_round_trips():
    """16-bit QDQ below opset 21 is written with com.microsoft Q/DQ; no integer kernel takes it, so
    each pair runs as its quantize and dequantize, as onnxruntime's does."""
    inits = [const("x_scale", np.float32(0.0004)), const("x_zero", np.array(30000, np.uint16)),
             const("w_q", RNG.integers(-127, 128, (24, 10)).astype(np.int16)), const("w_scale", np.float32(0.01)),
             const("w_zero", np.array(0, np.int16))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"]),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"])]
    graph = helper.make_graph(nodes, "qdq16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 24])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 10])], inits)
    model = in_contrib_domain(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    model.ir_version = 9
    feeds = {"x": RNG.standard_normal((4, 24)).astype(np.float32)}
    (want,) = onnxruntime_outputs(model, feeds)
    np.testing.assert_allclose(run_wasm(model, feeds)["y"], want, rtol=1e-5, atol=1e-5)


def test_a_relu_the_q_does_not_make_redundant_stays():
    model = qdq_conv(relu=True, y_zero=-10)     # the Q keeps values down to -10 * 0.05: the Relu matters
    ops = folded_ops(model)
    assert "Relu" in ops and "QLinearConv" not in ops, ops
    check_against_onnxruntime(model, {"x": RNG.standard_normal((1, 3, 9, 9)).astype(np.float32)})


def qdq_gemm(bias: bool, trans_b: bool, per_channel: bool):
    k, n = 16, 7
    shape = (n, k) if trans_b else (k, n)
    axis = (0 if trans_b else 1) if per_channel else None
    inits = quantized_weight("w", shape, S8, axis) + activation_params("x", 0.03, 0) + activation_params("y", 0.2, 1)
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]), dq("x", "x_dq"),
             dq("w", "w_dq", axis)]
    gemm_inputs = ["x_dq", "w_dq"]
    if bias:
        w_scale = numpy_helper.to_array(inits[1]).reshape(-1)
        inits += [const("b_q", RNG.integers(-300, 300, n).astype(np.int32)),
                  const("b_scale", np.float32(0.03) * w_scale if per_channel else np.float32(0.03) * w_scale[0]),
                  const("b_zero", np.zeros(n if per_channel else (), np.int32))]
        nodes.append(dq("b", "b_dq", 0 if per_channel else None))
        gemm_inputs.append("b_dq")
    nodes += [helper.make_node("Gemm", gemm_inputs, ["g"], transB=int(trans_b)),
              helper.make_node("QuantizeLinear", ["g", "y_scale", "y_zero"], ["y_q"])]
    return model_of(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                    [helper.make_tensor_value_info("y_q", S8, [3, n])], inits)


@pytest.mark.parametrize("bias,trans_b,per_channel", [(False, False, False), (False, True, True),
                                                      (True, False, False), (True, True, True)],
                         ids=["no-bias", "no-bias-transB-per-channel", "bias", "bias-transB-per-channel"])
def test_gemm_becomes_integer_ops(bias, trans_b, per_channel):
    model = qdq_gemm(bias, trans_b, per_channel)
    if bias:   # the int32 bias joins the int32 sum before the one rounding at the Q
        assert folded_ops(model) == ["QuantizeLinear", "MatMulInteger", "Add", "Cast", "Mul", "QuantizeLinear"]
    else:
        assert folded_ops(model) == ["QuantizeLinear", "QLinearMatMul"]
    check_against_onnxruntime(model, {"x": RNG.standard_normal((3, 16)).astype(np.float32)})


def test_a_float_model_is_unchanged():
    w = const("w", RNG.standard_normal((4, 3)).astype(np.float32))
    model = model_of([helper.make_node("MatMul", ["x", "w"], ["y"])],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    graph, records = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    assert [n.op_type for n in graph.nodes] == ["MatMul"]
    assert [(r.nodes_before, r.nodes_after) for r in records if r.name == "fold-qdq"] == [(1, 1)]


def qdq_layout(second_scale: float):
    """Q(a), Q(b) -> DQ -> Concat -> Q -> DQ -> Transpose -> Q -> DQ -> MaxPool -> Q, as the quantizer writes
    them; b quantized with `second_scale`."""
    inits = activation_params("a", 0.05, 2) + activation_params("b", second_scale, 2)
    nodes = [helper.make_node("QuantizeLinear", ["a", "a_scale", "a_zero"], ["a_q"]), dq("a", "a_dq"),
             helper.make_node("QuantizeLinear", ["b", "b_scale", "b_zero"], ["b_q"]), dq("b", "b_dq"),
             helper.make_node("Concat", ["a_dq", "b_dq"], ["c"], axis=1),
             helper.make_node("QuantizeLinear", ["c", "a_scale", "a_zero"], ["c_q"]),
             helper.make_node("DequantizeLinear", ["c_q", "a_scale", "a_zero"], ["c_dq"]),
             helper.make_node("Transpose", ["c_dq"], ["t"], perm=[0, 1, 3, 2]),
             helper.make_node("QuantizeLinear", ["t", "a_scale", "a_zero"], ["t_q"]),
             helper.make_node("DequantizeLinear", ["t_q", "a_scale", "a_zero"], ["t_dq"]),
             helper.make_node("MaxPool", ["t_dq"], ["p"], kernel_shape=[2, 2], pads=[1, 1, 0, 0]),
             helper.make_node("QuantizeLinear", ["p", "a_scale", "a_zero"], ["p_q"])]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 2, 4, 5]) for name in "ab"]
    return model_of(nodes, inputs, [helper.make_tensor_value_info("p_q", S8, [1, 4, 5, 4])], inits)


def test_exact_ops_between_dequantize_and_quantize_run_on_the_integers():
    feeds = {name: RNG.standard_normal((1, 2, 4, 5)).astype(np.float32) for name in "ab"}
    model = qdq_layout(second_scale=0.05)
    assert folded_ops(model) == ["QuantizeLinear", "QuantizeLinear", "Concat", "Transpose", "MaxPool"]
    (want,) = onnxruntime_outputs(model, feeds)
    np.testing.assert_array_equal(run_wasm(model, feeds)["p_q"], want)   # nothing is rounded twice
    # With b in another scale the Concat needs the float values; the ops after it still drop theirs.
    model = qdq_layout(second_scale=0.07)
    assert folded_ops(model) == ["QuantizeLinear", "DequantizeLinear", "QuantizeLinear", "DequantizeLinear",
                                 "Concat", "QuantizeLinear", "Transpose", "MaxPool"]
    check_against_onnxruntime(model, feeds)



def test_a_quantized_constant_that_no_integer_op_reads_folds_so_shapes_become_static():
    """The quantizer also quantizes the step of a Range over a dynamic length (a position index in
    an attention block): kept as a DequantizeLinear, it left the Range's length, and the shapes of
    everything after it, unknown. A DQ of a constant stays only for the ops fold-qdq runs on the integers."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 4])
    inits = [const("one", np.array([1], np.int64)), const("start", np.float32(0.0)),
             const("step_q", np.int8(1)), const("step_scale", np.float32(1.0)), const("step_zero", np.int8(0)),
             *activation_params("pos", 0.1, 0)]
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["t"]),
             helper.make_node("Cast", ["t"], ["t_float"], to=TensorProto.FLOAT),
             helper.make_node("Squeeze", ["t_float"], ["limit"]),
             helper.make_node("DequantizeLinear", ["step_q", "step_scale", "step_zero"], ["step"]),
             helper.make_node("Range", ["start", "limit", "step"], ["positions"]),
             helper.make_node("Unsqueeze", ["positions", "one"], ["column"]),
             helper.make_node("QuantizeLinear", ["column", "pos_scale", "pos_zero"], ["column_q"]),
             helper.make_node("DequantizeLinear", ["column_q", "pos_scale", "pos_zero"], ["column_dq"]),
             helper.make_node("Mul", ["x", "column_dq"], ["y"])]
    model = model_of(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 4])], inits)
    assert folded_ops(model) == ["Mul"]
    feeds = {"x": RNG.standard_normal((2, 5, 4)).astype(np.float32)}
    (want,) = onnxruntime_outputs(model, feeds)
    np.testing.assert_allclose(run_wasm(model, feeds)["y"], want, rtol=1e-6)

# -- the sample models, end to end ---------------------------------------------------------------
def cu_ops(dag_path) -> collections.Counter:
    found = collections.Counter()
    for path in glob.glob(str(dag_path.parent / "cus" / "*" / "cu.onnx")):
        found.update(n.op_type for n in onnx.load(path).graph.node)
    return found


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("sample,integer_ops", [(qdq_net, {"QLinearConv": 1, "QLinearMatMul": 1, "MatMulInteger": 1}),
                                                (qdq_squeezenet, {"QLinearConv": 26})], ids=["net", "squeezenet"])
def test_sample_cnns_run_integer_ops_on_wasm(sample, integer_ops, per_channel, tmp_path):
    case = sample(per_channel)
    dag_path = compile_pipeline(case.path, tmp_path, input_shapes=case.input_shapes, dims=case.dims)
    ops = cu_ops(dag_path)
    assert {op: ops[op] for op in integer_ops} == integer_ops
    assert not {"Conv", "MatMul", "Gemm"} & set(ops)
    got = cortex.load(dag_path, device="wasm").run(case.inputs)
    for name, want in case.outputs.items():
        # Each output is a DequantizeLinear of an int8 tensor: compare in quanta of its scale.
        quantum = max(np.min(np.diff(np.unique(want))), 1e-9) if np.unique(want).size > 1 else 1.0
        steps = np.abs(got[name] - want) / quantum
        assert steps.max() <= 1.01 and (steps < 0.01).mean() > 0.99, (steps.max(), (steps < 0.01).mean())
        assert np.abs(want).max() > 0


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_quantized_minilm_runs_integer_matmuls_on_wasm(per_channel, tmp_path):
    case = qdq_minilm(per_channel)
    dag_path = compile_pipeline(case.path, tmp_path, input_shapes=case.input_shapes, dims=case.dims)
    ops = cu_ops(dag_path)
    assert ops["QLinearMatMul"] == 48 and ops["MatMul"] == 0     # 6 layers x (Q, K, V, QK, AV, O, FF1, FF2)
    (want,) = case.outputs.values()
    (got,) = cortex.load(dag_path, device="wasm").run(case.inputs).values()
    # The output is float (a LayerNorm), computed from activations quantized 48 times: where Cortex's
    # float ops (Softmax, erf, LayerNorm) differ from onnxruntime's in the last bit just before a Q,
    # that Q may round the other way, and the one-quantum step travels on through the layers. The
    # same model with fold-qdq left out of the pipeline shows the same differences.
    diff = np.abs(got - want)
    assert np.mean(diff) < 1e-3 and np.quantile(diff, 0.9) < 1e-2 and diff.max() < 0.5, (np.mean(diff), diff.max())


def test_the_cli_compiles_and_verifies_the_quantized_net(tmp_path):
    case = qdq_net(per_channel=True)
    for argv in (["decompose", "--model-path", case.path, "--output-dir", tmp_path / "cus", "--dim", "batch=1"],
                 ["build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "dag.json"],
                 ["compile-wasm", "--cu-dir", tmp_path / "cus", "--dag", tmp_path / "dag.json",
                  "--output", tmp_path / "wasm"]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    assert cu_ops(tmp_path / "dag.json")["QLinearConv"] == 1
    np.save(tmp_path / "x.npy", case.inputs["x"])
    y_scale = {i.name: numpy_helper.to_array(i) for i in onnx.load(case.path).graph.initializer}["y_scale"]
    code, out, err = run_cli(["verify", tmp_path / "dag.json", "--model", case.path, "--input",
                              f"x={tmp_path / 'x.npy'}", "--rtol", "0", "--atol", str(1.01 * float(y_scale)), "--json"])
    assert code == 0 and json.loads(out)["ok"], (out, err)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_quantized_net_matches_onnxruntime_on_cuda_sim(tmp_path):
    case = qdq_net(per_channel=True)
    dag_path = compile_cuda_pipeline(case, tmp_path, archs=("sm_80",))
    assert cu_ops(dag_path)["QLinearConv"] == 1
    got = cortex.load(dag_path, device="cuda-sim").run(case.inputs)
    for name, want in case.outputs.items():
        quantum = float(np.min(np.diff(np.unique(want))))
        assert np.abs(got[name] - want).max() <= 1.01 * quantum
