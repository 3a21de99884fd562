"""Each op's loop-nest lowering, compiled to WebAssembly, matches onnxruntime: scalar (opt-level 0,
no SIMD), SIMD128 at opt-level 1 and 3, and with relaxed-SIMD fused multiply-add."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh

from wasm_cases import assert_matches_onnxruntime, make_model, run_wasm

rng = np.random.default_rng(0)


def vi(name, shape, dtype=T.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def out(name):
    """An output whose type onnxruntime infers."""
    return helper.make_empty_tensor_value_info(name)


def const(name, array):
    return nh.from_array(np.asarray(array), name)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def single(op, inputs, feeds, attrs=None, initializers=(), opset=17, outputs=("y",)):
    node = helper.make_node(op, list(inputs), list(outputs), **(attrs or {}))
    graph_inputs = [vi(n, list(a.shape), helper.np_dtype_to_tensor_dtype(a.dtype)) for n, a in feeds.items()]
    return make_model([node], graph_inputs, [out(o) for o in outputs], initializers, opset)


UNARY = ["Abs", "Neg", "Floor", "Ceil", "Round", "Sqrt", "Exp", "Log", "Sign", "Relu", "Sigmoid", "Tanh",
         "Softplus", "Softsign", "Erf", "Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Asinh", "Reciprocal",
         "HardSwish", "Mish"]


@pytest.mark.parametrize("op", UNARY)
def test_unary_math_matches_onnxruntime(op):
    x = (rng.standard_normal((3, 37)) * 3).astype(np.float32)
    if op in ("Sqrt", "Log"):
        x = np.abs(x) + 0.01
    assert_matches_onnxruntime(single(op, ["x"], {"x": x}, opset=18), {"x": x})


@pytest.mark.parametrize("op,attrs", [("LeakyRelu", {"alpha": 0.2}), ("Elu", {"alpha": 0.7}), ("Selu", {}),
                                      ("Celu", {"alpha": 1.5}), ("ThresholdedRelu", {"alpha": 0.3}),
                                      ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}), ("Shrink", {"lambd": 0.4, "bias": 0.1})])
def test_activations_with_attributes_match_onnxruntime(op, attrs):
    x = randn(2, 3, 9)
    assert_matches_onnxruntime(single(op, ["x"], {"x": x}, attrs), {"x": x})


def test_inverse_trig_and_hyperbolic_functions_match_onnxruntime():
    x = rng.uniform(-0.99, 0.99, (5, 13)).astype(np.float32)
    nodes = [helper.make_node(op, ["x"], [op.lower()]) for op in ("Asin", "Acos", "Atanh")]
    nodes.append(helper.make_node("Acosh", ["big"], ["acosh"]))
    big = (np.abs(x) + 1.0).astype(np.float32)
    model = make_model(nodes, [vi("x", [5, 13]), vi("big", [5, 13])], [out(n) for n in ("asin", "acos", "atanh", "acosh")])
    assert_matches_onnxruntime(model, {"x": x, "big": big})


def test_gelu_exact_and_tanh_approximation_match_onnxruntime():
    x = randn(4, 33) * 3
    nodes = [helper.make_node("Gelu", ["x"], ["a"]), helper.make_node("Gelu", ["x"], ["b"], approximate="tanh")]
    model = make_model(nodes, [vi("x", [4, 33])], [out("a"), out("b")], opset=20)
    assert_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "PRelu"])
def test_broadcasting_binary_ops_match_onnxruntime(op):
    a = np.abs(randn(2, 3, 4, 5)) + 0.5
    b = randn(3, 1, 5)
    if op == "PRelu":
        a, b = randn(2, 3, 4, 5), randn(1, 4, 1)
    assert_matches_onnxruntime(single(op, ["a", "b"], {"a": a, "b": b}), {"a": a, "b": b})


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8, np.uint8])
def test_integer_arithmetic_keeps_the_integer_type(dtype):
    a = rng.integers(1, 50, (4, 7)).astype(dtype)
    b = rng.integers(1, 9, (7,)).astype(dtype)
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Mul", ["a", "b"], ["m"]),
             helper.make_node("Div", ["a", "b"], ["d"]), helper.make_node("Mod", ["a", "b"], ["r"]),
             helper.make_node("Max", ["a", "b"], ["x"]), helper.make_node("Less", ["a", "b"], ["l"])]
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = make_model(nodes, [vi("a", [4, 7], t), vi("b", [7], t)], [out(n) for n in "smdrxl"])
    assert_matches_onnxruntime(model, {"a": a, "b": b})


def test_comparisons_logic_and_where_match_onnxruntime():
    a, b = randn(3, 8), randn(8)
    nodes = [helper.make_node("Greater", ["a", "b"], ["g"]), helper.make_node("LessOrEqual", ["a", "b"], ["le"]),
             helper.make_node("Equal", ["a", "a"], ["e"]), helper.make_node("Or", ["g", "e"], ["o"]),
             helper.make_node("Xor", ["g", "le"], ["x"]), helper.make_node("Not", ["g"], ["n"]),
             helper.make_node("Where", ["g", "a", "b"], ["w"]), helper.make_node("IsNaN", ["a"], ["nan"])]
    model = make_model(nodes, [vi("a", [3, 8]), vi("b", [8])], [out(n) for n in ("g", "le", "e", "o", "x", "n", "w", "nan")])
    assert_matches_onnxruntime(model, {"a": a, "b": b})


@pytest.mark.parametrize("to", [T.INT32, T.INT64, T.FLOAT16, T.DOUBLE, T.BOOL, T.UINT8, T.INT8])
def test_cast_from_float_matches_onnxruntime(to):
    x = (randn(4, 9) * 20).astype(np.float32)
    if to == T.UINT8:
        x = np.abs(x)
    assert_matches_onnxruntime(single("Cast", ["x"], {"x": x}, {"to": to}), {"x": x})


def test_float16_tensors_compute_in_float32_and_round_back():
    x = (randn(3, 17) * 100).astype(np.float16)
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"]), helper.make_node("Cast", ["y"], ["z"], to=T.FLOAT)]
    model = make_model(nodes, [vi("x", [3, 17], T.FLOAT16)], [out("y"), out("z")])
    assert_matches_onnxruntime(model, {"x": x}, rtol=1e-3, atol=1e-3)


def test_clip_with_bounds_from_inputs_and_attributes():
    x = randn(5, 11) * 4
    model = make_model([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], [vi("x", [5, 11])], [out("y")],
                       [const("lo", np.float32(-1.0)), const("hi", np.float32(2.0))])
    assert_matches_onnxruntime(model, {"x": x})
    old = make_model([helper.make_node("Clip", ["x"], ["y"], min=-0.5, max=0.5)], [vi("x", [5, 11])], [out("y")], opset=6)
    assert_matches_onnxruntime(old, {"x": x})


@pytest.mark.parametrize("attrs,wshape", [
    ({"pads": [1, 1, 1, 1]}, (4, 3, 3, 3)),
    ({"strides": [2, 2], "pads": [0, 1, 2, 1], "dilations": [1, 2], "group": 3}, (6, 1, 3, 2)),
    ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (5, 3, 3, 3)),
    ({}, (8, 3, 1, 1)),
])
def test_conv_matches_onnxruntime(attrs, wshape):
    x = randn(2, 3, 11, 10)
    model = single("Conv", ["x", "w", "b"], {"x": x}, attrs, [const("w", randn(*wshape)), const("b", randn(wshape[0]))])
    assert_matches_onnxruntime(model, {"x": x})


def test_conv1d_without_bias_matches_onnxruntime():
    x = randn(1, 4, 20)
    model = single("Conv", ["x", "w"], {"x": x}, {"strides": [3], "pads": [2, 1]}, [const("w", randn(6, 4, 5))])
    assert_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("op,attrs", [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("MaxPool", {"kernel_shape": [2, 2], "dilations": [2, 2]}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [2, 3], "strides": [2, 1], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("LpPool", {"kernel_shape": [2, 2], "p": 2}),
    ("GlobalAveragePool", {}), ("GlobalMaxPool", {}),
])
def test_pooling_matches_onnxruntime(op, attrs):
    x = randn(2, 3, 10, 9)
    assert_matches_onnxruntime(single(op, ["x"], {"x": x}, attrs, opset=18), {"x": x})


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
@pytest.mark.parametrize("shape,attrs", [
    ((1, 3, 17, 19), {"kernel_shape": [3, 3], "strides": [2, 2]}),                  # stride-2 loads, odd sizes
    ((2, 2, 20, 23), {"kernel_shape": [3, 3], "strides": [3, 3], "ceil_mode": 1}),  # stride 3, ceil_mode
    ((1, 2, 21, 33), {"kernel_shape": [5, 2], "strides": [1, 4], "pads": [2, 1, 2, 1]}),  # lane loads, pads
    ((1, 4, 15, 15), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [0, 0, 1, 1]}),
    ((1, 3, 16, 18), {"kernel_shape": [7, 6], "strides": [2, 2], "pads": [3, 3, 3, 3]}),  # 42 taps: accumulates
    ((2, 5, 7, 7), {"kernel_shape": [7, 7]}),                                        # 49 taps, one output
    ((1, 3, 10, 11), {"kernel_shape": [6, 8], "strides": [3, 2], "pads": [1, 1, 1, 0]}),  # narrow rows
    ((2, 3, 31), {"kernel_shape": [3], "strides": [2], "ceil_mode": 1}),
    ((1, 2, 9, 12), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ((1, 3, 8, 8), {"kernel_shape": [2, 2], "strides": [3, 3], "pads": [1, 1, 1, 1], "dilations": [2, 2]}),
])
def test_strided_pooling_matches_onnxruntime(op, shape, attrs):
    x = randn(*shape)
    assert_matches_onnxruntime(single(op, ["x"], {"x": x}, attrs, opset=19), {"x": x})   # 19: dilated AveragePool


@pytest.mark.parametrize("attrs", [{}, {"transA": 1}, {"transB": 1, "alpha": 0.5, "beta": 2.0}])
def test_gemm_matches_onnxruntime(attrs):
    a = randn(13, 6) if attrs.get("transA") else randn(6, 13)
    w = randn(7, 13) if attrs.get("transB") else randn(13, 7)
    model = single("Gemm", ["a", "w", "c"], {"a": a}, attrs, [const("w", w), const("c", randn(7))])
    assert_matches_onnxruntime(model, {"a": a})


@pytest.mark.parametrize("ashape,bshape", [((5, 6), (6, 9)), ((2, 3, 5, 6), (6, 7)), ((3, 1, 4, 6), (2, 6, 5)),
                                           ((6,), (6, 4)), ((2, 5, 6), (6,))])
def test_matmul_with_broadcast_batches_matches_onnxruntime(ashape, bshape):
    a, b = randn(*ashape), randn(*bshape)
    assert_matches_onnxruntime(single("MatMul", ["a", "b"], {"a": a, "b": b}), {"a": a, "b": b})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("axis,opset", [(-1, 17), (1, 17), (1, 11)])
def test_softmax_family_matches_onnxruntime(op, axis, opset):
    x = randn(2, 5, 7) * 3
    assert_matches_onnxruntime(single(op, ["x"], {"x": x}, {"axis": axis}, opset=opset), {"x": x})


def test_attention_softmax_on_minilm_shapes_matches_onnxruntime():
    """MiniLM's scores: 12 heads of 128 x 128, a large negative mask on some keys, softmax on the last axis."""
    x = randn(1, 12, 128, 128) * 4
    x[..., 100:] -= 1e4
    assert_matches_onnxruntime(single("Softmax", ["x"], {"x": x}, {"axis": -1}), {"x": x})


def test_normalizations_match_onnxruntime():
    x = randn(2, 4, 5, 6)
    s, b, m, v = randn(4), randn(4), randn(4), np.abs(randn(4)) + 0.1
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["bn"], epsilon=1e-3),
             helper.make_node("InstanceNormalization", ["x", "s", "b"], ["inorm"]),
             helper.make_node("LRN", ["x"], ["lrn"], size=3, alpha=0.01, beta=0.6, bias=1.5),
             helper.make_node("LayerNormalization", ["x", "g", "h"], ["ln"], axis=-2)]
    model = make_model(nodes, [vi("x", [2, 4, 5, 6])], [out(n) for n in ("bn", "inorm", "lrn", "ln")],
                       [const("s", s), const("b", b), const("m", m), const("v", v), const("g", randn(5, 6)), const("h", randn(6))])
    assert_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                                "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"])
@pytest.mark.parametrize("axes,keepdims", [([1], 1), ([0, 2], 0), (None, 1)])
def test_reductions_match_onnxruntime(op, axes, keepdims):
    x = randn(3, 4, 5)
    inits = [const("axes", np.array(axes, dtype=np.int64))] if axes is not None else []
    model = single(op, ["x", "axes"] if axes is not None else ["x"], {"x": x}, {"keepdims": keepdims}, inits, opset=18)
    assert_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_reductions_match_onnxruntime(op):
    x = np.round(randn(3, 6, 4))      # ties, so select_last_index matters
    nodes = [helper.make_node(op, ["x"], ["a"], axis=1), helper.make_node(op, ["x"], ["b"], axis=-1, keepdims=0,
                                                                          select_last_index=1)]
    assert_matches_onnxruntime(make_model(nodes, [vi("x", [3, 6, 4])], [out("a"), out("b")]), {"x": x})


def test_layout_ops_match_onnxruntime():
    x = randn(2, 3, 4, 5)
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
             helper.make_node("Concat", ["t", "t"], ["c"], axis=2),
             helper.make_node("Reshape", ["c", "shape"], ["r"]),
             helper.make_node("Split", ["x", "split"], ["s1", "s2"], axis=3),
             helper.make_node("Slice", ["x", "st", "en", "ax", "stp"], ["sl"]),
             helper.make_node("Expand", ["b", "eshape"], ["ex"]),
             helper.make_node("Tile", ["x", "reps"], ["ti"]),
             helper.make_node("Flatten", ["x"], ["fl"], axis=2),
             helper.make_node("DepthToSpace", ["d"], ["d2s"], blocksize=2, mode="CRD"),
             helper.make_node("DepthToSpace", ["d"], ["d2s_dcr"], blocksize=2),
             helper.make_node("SpaceToDepth", ["x4"], ["s2d"], blocksize=2)]
    inits = [const("shape", np.array([2, -1], dtype=np.int64)), const("split", np.array([2, 3], dtype=np.int64)),
             const("st", np.array([3, -1], dtype=np.int64)), const("en", np.array([0, -100], dtype=np.int64)),
             const("ax", np.array([2, 3], dtype=np.int64)), const("stp", np.array([-1, -2], dtype=np.int64)),
             const("eshape", np.array([2, 3, 4, 5], dtype=np.int64)), const("reps", np.array([1, 2, 1, 3], dtype=np.int64))]
    outs = ["r", "s1", "s2", "sl", "ex", "ti", "fl", "d2s", "d2s_dcr", "s2d"]
    model = make_model(nodes, [vi("x", [2, 3, 4, 5]), vi("b", [3, 1, 5]), vi("d", [1, 8, 3, 2]), vi("x4", [1, 2, 4, 6])],
                       [out(n) for n in outs], inits)
    assert_matches_onnxruntime(model, {"x": x, "b": randn(3, 1, 5), "d": randn(1, 8, 3, 2), "x4": randn(1, 2, 4, 6)})


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect"])
def test_pad_modes_match_onnxruntime(mode):
    x = randn(2, 3, 5)
    model = single("Pad", ["x", "pads", "value"], {"x": x}, {"mode": mode},
                   [const("pads", np.array([0, 2, 1, 1, 1, 3], dtype=np.int64)), const("value", np.float32(0.5))])
    assert_matches_onnxruntime(model, {"x": x})


def test_gathers_and_scatters_match_onnxruntime():
    data = randn(5, 4, 3)
    nodes = [helper.make_node("Gather", ["data", "ids"], ["g0"]),
             helper.make_node("Gather", ["data", "ids"], ["g1"], axis=1),
             helper.make_node("GatherElements", ["data", "ge"], ["gel"], axis=1),
             helper.make_node("GatherND", ["data", "gnd"], ["gn"]),
             helper.make_node("ScatterElements", ["data", "ge", "upd"], ["se"], axis=1, reduction="add"),
             helper.make_node("ScatterND", ["data", "snd", "updnd"], ["sn"])]
    ids = np.array([[0, -1], [2, 3]], dtype=np.int64)
    ge = rng.integers(-4, 4, (5, 2, 3)).astype(np.int64)
    model = make_model(nodes, [vi("data", [5, 4, 3]), vi("ids", [2, 2], T.INT64)],
                       [out(n) for n in ("g0", "g1", "gel", "gn", "se", "sn")],
                       [const("ge", ge), const("gnd", np.array([[1, 2], [4, -1]], dtype=np.int64)),
                        const("upd", randn(5, 2, 3)), const("snd", np.array([[1], [3]], dtype=np.int64)),
                        const("updnd", randn(2, 4, 3))], opset=18)
    assert_matches_onnxruntime(model, {"data": data, "ids": ids})


def test_embedding_lookup_with_attention_mask_arithmetic_matches_onnxruntime():
    """The MiniLM front end in miniature: Gather, Cast, Unsqueeze, Sub, Mul, Where on int64 masks."""
    ids = rng.integers(0, 10, (2, 6)).astype(np.int64)
    mask = rng.integers(0, 2, (2, 6)).astype(np.int64)
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"]),
             helper.make_node("Cast", ["mask"], ["mf"], to=T.FLOAT),
             helper.make_node("Unsqueeze", ["mf", "ax"], ["mu"]),
             helper.make_node("Sub", ["one", "mu"], ["inv"]),
             helper.make_node("Mul", ["inv", "big"], ["bias"]),
             helper.make_node("Add", ["e", "bias"], ["y"]),
             helper.make_node("Equal", ["mask", "zero"], ["z"]),
             helper.make_node("Where", ["z", "zero", "ids"], ["w"])]
    inits = [const("emb", randn(10, 8)), const("ax", np.array([2], dtype=np.int64)), const("one", np.float32(1)),
             const("big", np.float32(-1e4)), const("zero", np.array(0, dtype=np.int64))]
    model = make_model(nodes, [vi("ids", [2, 6], T.INT64), vi("mask", [2, 6], T.INT64)], [out("y"), out("w")], inits)
    assert_matches_onnxruntime(model, {"ids": ids, "mask": mask})


@pytest.mark.parametrize("flag", [True, False])
def test_if_runs_the_branch_the_condition_picks(flag):
    x = randn(3, 4)
    then_graph = helper.make_graph([helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Add", ["t", "one"], ["a"])],
                                   "then", [], [vi("a", [3, 4])], [const("one", np.float32(1.0))])
    else_graph = helper.make_graph([helper.make_node("Neg", ["x"], ["b"])], "else", [], [vi("b", [3, 4])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_graph, else_branch=else_graph)
    model = make_model([node], [vi("c", [], T.BOOL), vi("x", [3, 4])], [vi("y", [3, 4])])
    assert_matches_onnxruntime(model, {"c": np.array(flag), "x": x})


def test_gemm_kernels_absorb_bias_and_relu_epilogues():
    """MatMul -> Add(bias) -> Relu and Conv -> Relu run as one GEMM kernel each, and still match."""
    x, img = randn(2, 5, 8), randn(1, 3, 6, 6)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["bias", "mm"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"]),
             helper.make_node("Conv", ["img", "k"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["z"])]
    model = make_model(nodes, [vi("x", [2, 5, 8]), vi("img", [1, 3, 6, 6])], [out("y"), out("z")],
                       [const("w", randn(8, 16)), const("bias", randn(16)), const("k", randn(4, 3, 3, 3))])
    assert_matches_onnxruntime(model, {"x": x, "img": img}, configs=[("simd,bulk-memory", "2"), ("", "1")])
    from codegen.lower import lower_graph
    from backends.wasm.intrinsics import kernels as target_kernels
    from backends.wasm.options import parse_options
    from ir.onnx_import import import_model
    from passes import optimize_pipeline, run_pipeline
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    program = lower_graph(graph, target_kernels(parse_options(None, None, "2")))
    assert sorted(k.op_type for k in program.kernels if k.body) == ["Conv", "MatMul"]


def test_an_intermediate_graph_output_is_not_fused_away():
    x = randn(3, 8)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Relu", ["mm"], ["y"])]
    model = make_model(nodes, [vi("x", [3, 8])], [out("mm"), out("y")], [const("w", randn(8, 4))])
    assert_matches_onnxruntime(model, {"x": x}, configs=[("simd,bulk-memory", "2")])


def test_gather_with_a_constant_scalar_index_drops_the_axis():
    x = randn(3, 4)
    model = single("Gather", ["x", "i"], {"x": x}, {"axis": 1}, [const("i", np.array(-1, dtype=np.int64))])
    assert_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("src,dst", [(np.float32, np.int32), (np.float32, np.uint32), (np.uint32, np.float32),
                                     (np.float64, np.int64), (np.int8, np.uint8)])
def test_bitcast_keeps_the_bits(src, dst):
    # BitCast (opset 26) is newer than onnxruntime: numpy's view is the reference
    x = (rng.standard_normal(12) * 100).astype(src) if np.dtype(src).kind == "f" else \
        rng.integers(np.iinfo(src).min, np.iinfo(src).max, 12).astype(src)
    model = single("BitCast", ["x"], {"x": x}, {"to": helper.np_dtype_to_tensor_dtype(np.dtype(dst))}, opset=26)
    for features, level in [("", "0"), ("simd,bulk-memory", "3")]:
        np.testing.assert_array_equal(run_wasm(model, {"x": x}, features, level)["y"], x.view(dst))


@pytest.mark.parametrize("onesided", [0, 1])
def test_dft_matches_numpy(onesided):
    x = randn(2, 12, 1)
    model = single("DFT", ["x"], {"x": x}, {"axis": 1, "onesided": onesided}, opset=17)
    want = np.fft.rfft(x[..., 0], axis=1) if onesided else np.fft.fft(x[..., 0], axis=1)
    got = run_wasm(model, {"x": x}, "simd,bulk-memory", "2")["y"]
    np.testing.assert_allclose(got, np.stack([want.real, want.imag], axis=-1), rtol=1e-4, atol=1e-5)


def _gelu_diamond(x, variant):
    """x * 0.5 * (1 + erf(x / sqrt 2)) from `x`, as the exporters spell it; returns (nodes, output name)."""
    n = helper.make_node
    scale = n("Div", [x, "sqrt2"], ["d"]) if variant != "mul-inverse" else n("Mul", ["inv_sqrt2", x], ["d"])
    head = [scale, n("Erf", ["d"], ["e"]), n("Add", ["one", "e"] if variant == "swapped" else ["e", "one"], ["p"])]
    if variant == "half-first":          # (x * 0.5) * (1 + erf)
        return head + [n("Mul", ["half", x], ["h"]), n("Mul", ["p", "h"], ["g"])], "g"
    if variant == "half-on-erf":         # x * ((1 + erf) * 0.5)
        return head + [n("Mul", ["p", "half"], ["h"]), n("Mul", [x, "h"], ["g"])], "g"
    first = n("Mul", ["p", x], ["m"]) if variant == "swapped" else n("Mul", [x, "p"], ["m"])
    return head + [first, n("Mul", ["half", "m"] if variant == "swapped" else ["m", "half"], ["g"])], "g"


_GELU_CONSTANTS = [const("sqrt2", np.float32(np.sqrt(2))), const("inv_sqrt2", np.float32(1 / np.sqrt(2))),
                   const("one", np.float32(1)), const("half", np.float32(0.5))]


def _kernel_op_types(model):
    from backends.wasm.intrinsics import kernels as target_kernels
    from backends.wasm.options import parse_options
    from codegen.lower import lower_graph
    from ir.onnx_import import import_model
    from passes import optimize_pipeline, run_pipeline
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return sorted(k.op_type for k in lower_graph(graph, target_kernels(parse_options(None, "simd", "2"))).kernels if k.body)


@pytest.mark.parametrize("variant", ["hf", "swapped", "mul-inverse", "half-first", "half-on-erf"])
@pytest.mark.parametrize("bias", [True, False])
def test_erf_gelu_after_matmul_runs_as_the_gemm_epilogue(variant, bias):
    x = randn(2, 6, 8) * 2
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"])]
    if bias:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["mmb"]))
    gelu, y = _gelu_diamond("mmb" if bias else "mm", variant)
    model = make_model(nodes + gelu, [vi("x", [2, 6, 8])], [helper.make_tensor_value_info(y, T.FLOAT, None)],
                       [const("w", randn(8, 20)), const("b", randn(20))] + _GELU_CONSTANTS)
    assert_matches_onnxruntime(model, {"x": x}, configs=[("simd,bulk-memory", "2"), ("simd,relaxed-simd", "3"),
                                                         ("", "1")])
    assert _kernel_op_types(model) == ["MatMul"]


def test_onnx_gelu_after_gemm_runs_as_the_gemm_epilogue():
    x = randn(5, 8) * 2
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["mm"], transB=1), helper.make_node("Gelu", ["mm"], ["y"])]
    model = make_model(nodes, [vi("x", [5, 8])], [out("y")], [const("w", randn(12, 8)), const("b", randn(12))],
                       opset=20)
    assert_matches_onnxruntime(model, {"x": x}, configs=[("simd,bulk-memory", "2")])
    assert _kernel_op_types(model) == ["Gemm"]


def test_a_gelu_whose_inner_value_is_also_an_output_is_not_absorbed():
    x = randn(3, 8)
    gelu, y = _gelu_diamond("mm", "hf")
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["mm"])] + gelu, [vi("x", [3, 8])],
                       [out(y), out("e")], [const("w", randn(8, 4))] + _GELU_CONSTANTS)
    assert_matches_onnxruntime(model, {"x": x}, configs=[("simd,bulk-memory", "2")])
    assert "Erf" in _kernel_op_types(model)


@pytest.mark.parametrize("group", [1, 3])    # 3: depthwise
def test_erf_gelu_after_conv_runs_as_the_conv_epilogue(group):
    img = randn(1, 3, 7, 7)
    gelu, y = _gelu_diamond("c", "half-first")
    channels = 3 if group == 3 else 5
    model = make_model([helper.make_node("Conv", ["img", "k", "kb"], ["c"], pads=[1, 1, 1, 1], group=group)] + gelu,
                       [vi("img", [1, 3, 7, 7])], [out(y)],
                       [const("k", randn(channels, 3 // group, 3, 3)), const("kb", randn(channels))] + _GELU_CONSTANTS)
    assert_matches_onnxruntime(model, {"img": img}, configs=[("simd,bulk-memory", "2"), ("", "1")])
    assert _kernel_op_types(model) == ["Conv"]


@pytest.mark.parametrize("residual_first", [False, True], ids=["product+residual", "residual+product"])
@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
def test_a_residual_add_after_matmul_and_bias_runs_in_the_gemm_kernel(op, residual_first):
    """MiniLM's attention-output and FFN-output pattern: MatMul -> Add(bias) -> Add(residual), the
    residual an activation of exactly the product's shape, added in either operand order."""
    x, r = randn(2, 6, 8), randn(2, 6, 20)
    if op == "MatMul":
        nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["mmb"])]
        shapes, w = ([2, 6, 8], [2, 6, 20]), randn(8, 20)
    else:
        x, r = x.reshape(12, 8), r.reshape(12, 20)
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["mmb"], transB=1)]
        shapes, w = ([12, 8], [12, 20]), randn(20, 8)
    nodes.append(helper.make_node("Add", ["r", "mmb"] if residual_first else ["mmb", "r"], ["y"]))
    model = make_model(nodes, [vi("x", shapes[0]), vi("r", shapes[1])], [out("y")], [const("w", w), const("b", randn(20))])
    assert_matches_onnxruntime(model, {"x": x, "r": r}, configs=[("simd,bulk-memory", "2"), ("simd,relaxed-simd", "3"),
                                                                 ("", "1")])
    assert _kernel_op_types(model) == [op]


def test_a_residual_add_with_a_broadcast_operand_stays_a_pass_of_its_own():
    """An Add whose other operand broadcasts (one row here) is not a residual the kernel can read."""
    x, r = randn(2, 6, 8), randn(1, 6, 20)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "r"], ["y"])]
    model = make_model(nodes, [vi("x", [2, 6, 8]), vi("r", [1, 6, 20])], [out("y")], [const("w", randn(8, 20))])
    assert_matches_onnxruntime(model, {"x": x, "r": r}, configs=[("simd,bulk-memory", "2")])
    assert _kernel_op_types(model) == ["Add", "MatMul"]


def test_a_residual_computed_after_the_product_in_graph_order_stays_a_pass_of_its_own():
    """The kernel reads the residual while it writes the output: one whose producer comes later in
    graph order has not run yet when the product's kernel does."""
    x = randn(4, 8)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Relu", ["x"], ["late"]),
             helper.make_node("MatMul", ["late", "w"], ["r"]), helper.make_node("Add", ["mm", "r"], ["y"])]
    model = make_model(nodes, [vi("x", [4, 8])], [out("y")], [const("w", randn(8, 8))])
    assert_matches_onnxruntime(model, {"x": x}, configs=[("simd,bulk-memory", "2")])
    # the second product's kernel takes the Add: its residual, the first product, ran before it
    assert _kernel_op_types(model) == ["MatMul", "MatMul", "Relu"]


def test_a_relu_after_a_batch_norm_runs_in_the_same_pass():
    x = randn(2, 4, 5, 6)
    s, b, m, v = randn(4), randn(4), randn(4), np.abs(randn(4)) + 0.1
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["bn"], epsilon=1e-3),
             helper.make_node("Relu", ["bn"], ["y"])]
    model = make_model(nodes, [vi("x", [2, 4, 5, 6])], [out("y")],
                       [const("s", s), const("b", b), const("m", m), const("v", v)])
    assert_matches_onnxruntime(model, {"x": x})
    assert _kernel_op_types(model) == ["BatchNormalization"]


def test_softmax_rows_with_nan_or_minus_infinity_match_onnxruntime():
    """The running maximum ignores a NaN, but the NaN still reaches the sum of exponentials, so the
    row is NaN as in onnxruntime; -inf entries (masked keys) give zeros."""
    x = randn(3, 4, 9)
    x[0, 1, 3] = np.nan
    x[1, 2, :5] = -np.inf
    x[2, 0, 8] = np.nan
    for op in ("Softmax", "LogSoftmax"):
        assert_matches_onnxruntime(single(op, ["x"], {"x": x}, {"axis": -1}), {"x": x})


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_vector_max_and_min_reductions_give_the_scalar_results_nan_included(op):
    """Vector max/min reductions run on pmax/pmin plus a record of NaN lanes: a row with a NaN
    anywhere (vector part or scalar tail) reduces to NaN, as wasm's scalar max/min do. (onnxruntime
    skips NaN in ReduceMax; Cortex's scalar loops never did, so the scalar build is the reference.)"""
    x = randn(4, 3, 23)
    x[0, 1, 2] = x[1, 0, 21] = x[3, 2, 10] = np.nan
    x[2, 2, 5] = -np.inf
    model = single(op, ["x", "axes"], {"x": x}, {"keepdims": 0}, [const("axes", np.array([2], dtype=np.int64))],
                   opset=18)
    scalar = run_wasm(model, {"x": x}, "", "0")["y"]
    assert np.isnan(scalar).sum() == 3
    for features, level in [("simd", "1"), ("simd,relaxed-simd", "3")]:
        np.testing.assert_array_equal(run_wasm(model, {"x": x}, features, level)["y"], scalar)


@pytest.mark.parametrize("beta", [0.75, 0.5, 1.0, 0.6])
def test_lrn_powers_match_onnxruntime(beta):
    """beta 0.75 (AlexNet, GoogLeNet), 0.5 and 1 use square roots and a division; others pow."""
    x = randn(1, 7, 9, 11) * 3
    model = single("LRN", ["x"], {"x": x}, {"size": 5, "alpha": 1e-2, "beta": beta, "bias": 1.0})
    assert_matches_onnxruntime(model, {"x": x})
