"""Models as exporters and converters really write them: `-1` / `0` dynamic dims, opset domains no
node uses, and the contrib ops onnxruntime's quantizer and transformer optimizer write.

The models are built here with onnx.helper, or with onnxruntime's public tools
(samples/contrib_models.py, cached under .cache/).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import assert_one_line_error, build_and_run, run_cli
from ir.onnx_export import export_model
from ir.onnx_import import import_model, load_model
from passes import InferShapes
from samples import contrib_models as contrib
from testdata import minilm_feed, run_onnxruntime

RNG = np.random.default_rng(0)


def conv_model(input_dims, output_dims, hidden_dims, extra_opsets=()) -> onnx.ModelProto:
    """Conv -> Relu -> global pool -> flatten -> MatMul, with the declared dims given."""
    w = numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    fc = numpy_helper.from_array(RNG.standard_normal((4, 5)).astype(np.float32), "fc")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["h"], name="relu"),
             helper.make_node("GlobalAveragePool", ["h"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("MatMul", ["f", "fc"], ["y"], name="fc")]
    graph = helper.make_graph(nodes, "paddle_like",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, input_dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_dims)], [w, fc],
                              value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, hidden_dims)])
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, 1) for d in extra_opsets)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


MINUS_ONE = conv_model([-1, 3, -1, -1], [-1, 5], [-1, 4, -1, -1])
ZERO_OUTPUTS = conv_model([-1, 3, 6, 10], [0, 5], [0, 4, 0, 10])


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def cli_ok(argv) -> str:
    code, out, err = run_cli(argv)
    assert code == 0, f"{argv[0]}: {err}"
    return out


def compile_and_run(model_path: Path, tmp: Path, feed: np.ndarray) -> np.ndarray:
    shape = "x=" + "x".join(map(str, feed.shape))
    np.save(tmp / "x.npy", feed)
    cli_ok(["decompose", "--model-path", model_path, "--output-dir", tmp / "cus", "--input-shape", shape])
    cli_ok(["build-dag", "--cu-dir", tmp / "cus", "--output", tmp / "dag.json"])
    cli_ok(["compile-wasm", "--cu-dir", tmp / "cus", "--output", tmp / "wasm", "--dag", tmp / "dag.json"])
    cli_ok(["run", tmp / "dag.json", "--input", f"x={tmp / 'x.npy'}", "--output", tmp / "out.npz"])
    return np.load(tmp / "out.npz")["y"]


def inspect_json(model_path: Path, *argv) -> dict:
    return json.loads(cli_ok(["inspect", model_path, "--json", *argv]))


@pytest.mark.parametrize("model", [MINUS_ONE, ZERO_OUTPUTS], ids=["minus-one", "zero-outputs"])
def test_exporter_dynamic_dims_compile_and_match_onnxruntime(model, tmp_path):
    path = save(model, tmp_path / "model.onnx")
    feed = RNG.standard_normal((2, 3, 6, 10)).astype(np.float32)
    got = compile_and_run(path, tmp_path, feed)
    want = run_onnxruntime(model, {"x": feed})["y"]
    assert got.shape == want.shape == (2, 5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_minus_one_dims_are_listed_as_dynamic_and_bound_by_input_shape(tmp_path):
    path = save(MINUS_ONE, tmp_path / "model.onnx")
    report = inspect_json(path)
    assert report["source"]["dynamic_dims"] == ["x[0]", "x[2]", "x[3]"]
    assert report["source"]["inputs"][0]["shape"] == [None, 3, None, None]
    bound = inspect_json(path, "--input-shape", "x=1x3x48x192")
    assert bound["optimized"]["inputs"][0]["shape"] == [1, 3, 48, 192]
    assert bound["optimized"]["outputs"][0]["shape"] == [1, 5]
    assert bound["optimized"]["dynamic_dims"] == []


def test_unbound_minus_one_dim_is_one_line_naming_the_input(tmp_path):
    path = save(MINUS_ONE, tmp_path / "model.onnx")
    code, _, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "'x'", "--input-shape x=")
    assert not (tmp_path / "cus").exists()


def test_zero_in_a_graph_input_is_an_empty_dim_as_in_onnxruntime():
    """onnxruntime refuses any other size for an input declared with dim_value 0, so it stays 0; zeros in
    initializers and Constant nodes are data and stay too."""
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty")
    const = helper.make_node("Constant", [], ["k"], name="k",
                             value=numpy_helper.from_array(np.zeros((2, 0), np.float32)))
    nodes = [const, helper.make_node("Concat", ["x", "empty"], ["y"], name="cat", axis=0)]
    graph = helper.make_graph(nodes, "zeros", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [0, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [0, 4]),
                               helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 0])], [empty])
    g = import_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert g.inputs[0].shape == (0, 4)
    assert g.outputs[0].shape is None or g.outputs[0].shape[0] is None
    assert sorted(v.shape for v in g.constants()) == [(0, 4), (2, 0)]
    InferShapes(require_static=True).run(g)
    assert g.outputs[0].shape == (0, 4)


# -- opset domains -------------------------------------------------------------------------------
UNUSED_DOMAINS = ("com.microsoft.mlfeaturizers", "com.microsoft.experimental", "ai.onnx.training")


@pytest.mark.parametrize("returned", ["x", "fc"], ids=["its-input", "a-weight"])
def test_a_model_that_also_returns_its_input_or_a_weight_compiles(returned, tmp_path):
    """Some exporters list a graph input or an initializer among the outputs (a pass-through of
    the image, an embedding table); the other nodes' shapes must still be inferred."""
    model = conv_model([2, 3, 6, 10], [2, 5], [2, 4, 6, 10])
    model.graph.output.append(helper.make_tensor_value_info(returned, TensorProto.FLOAT, None))
    path = save(model, tmp_path / "model.onnx")
    feed = {"x": RNG.standard_normal((2, 3, 6, 10)).astype(np.float32)}
    got, want = build_and_run(path, tmp_path, feed), run_onnxruntime(model, feed)
    assert sorted(got) == sorted(want) == sorted(["y", returned])
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_decoder_step_with_an_empty_past_matches_onnxruntime(tmp_path):
    """The first step of a decoder exported with its key/value cache as inputs feeds a past of
    length 0 (`--input-shape past_k=2x0x8`): the scores over an empty past are an empty GEMM, and a
    MatMul whose K is 0 is all zeros plus its bias."""
    vi = helper.make_tensor_value_info
    bias = numpy_helper.from_array(RNG.standard_normal(8).astype(np.float32), "bias")
    nodes = [helper.make_node("Concat", ["past_k", "k"], ["keys"], axis=1),
             helper.make_node("Transpose", ["past_k"], ["past_kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "past_kt"], ["past_scores"]),
             helper.make_node("MatMul", ["past_scores", "past_k"], ["from_past"]),
             helper.make_node("Add", ["from_past", "bias"], ["past_term"]),
             helper.make_node("Transpose", ["keys"], ["keys_t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "keys_t"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["weights"], axis=-1),
             helper.make_node("MatMul", ["weights", "keys"], ["attended"]),
             helper.make_node("Add", ["attended", "past_term"], ["y"])]
    graph = helper.make_graph(nodes, "decoder_step",
                              [vi("q", TensorProto.FLOAT, [2, 3, 8]), vi("k", TensorProto.FLOAT, [2, 3, 8]),
                               vi("past_k", TensorProto.FLOAT, [2, "past", 8])],
                              [vi("y", TensorProto.FLOAT, None), vi("keys", TensorProto.FLOAT, None)], [bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = save(model, tmp_path / "model.onnx")
    feed = {"q": RNG.standard_normal((2, 3, 8)).astype(np.float32), "k": RNG.standard_normal((2, 3, 8)).astype(np.float32),
            "past_k": np.zeros((2, 0, 8), np.float32)}
    got = build_and_run(path, tmp_path, feed, "--input-shape", "past_k=2x0x8")
    want = run_onnxruntime(model, feed)
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_unused_unknown_domains_are_accepted(tmp_path):
    model = conv_model([1, 3, 6, 10], [1, 5], [1, 4, 6, 10], extra_opsets=UNUSED_DOMAINS)
    path = save(model, tmp_path / "model.onnx")
    report = inspect_json(path)
    assert not set(UNUSED_DOMAINS) & set(report["source"]["opsets"])
    feed = RNG.standard_normal((1, 3, 6, 10)).astype(np.float32)
    got = compile_and_run(path, tmp_path, feed)
    np.testing.assert_allclose(got, run_onnxruntime(model, {"x": feed})["y"], rtol=1e-4, atol=1e-5)
    for cu in sorted((tmp_path / "cus").glob("cu-*/cu.onnx")):
        onnx.checker.check_model(onnx.load(cu), full_check=True)


def test_exported_model_without_the_unused_domains_passes_the_checker():
    model = conv_model([1, 3, 6, 10], [1, 5], [1, 4, 6, 10], extra_opsets=UNUSED_DOMAINS)
    exported = export_model(import_model(model))
    onnx.checker.check_model(exported, full_check=True)
    assert {o.domain for o in exported.opset_import} == {""}


def frob_model(where: str) -> onnx.ModelProto:
    """A node of domain com.example in the main graph, an If branch, or a model-local function."""
    frob = helper.make_node("Frobnicate", ["x"], ["y"], name="frob", domain="com.example")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    functions = []
    if where == "graph":
        nodes = [frob]
    elif where == "subgraph":
        branch = helper.make_graph([frob], "branch", [], [y])
        cond = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True)))
        nodes = [cond, helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch, else_branch=branch)]
    else:
        functions = [helper.make_function("local", "Wrap", ["x"], ["y"], [frob], opsets)]
        nodes = [helper.make_node("Wrap", ["x"], ["y"], name="wrap", domain="local")]
        opsets.append(helper.make_opsetid("local", 1))
    graph = helper.make_graph(nodes, "frob", [x], [y])
    return helper.make_model(graph, opset_imports=opsets, functions=functions)


@pytest.mark.parametrize("where", ["graph", "subgraph", "function"])
def test_a_node_of_an_unknown_domain_is_one_line_naming_it(where, tmp_path):
    path = save(frob_model(where), tmp_path / "model.onnx")
    code, _, err = run_cli(["inspect", path])
    assert_one_line_error(code, err, "'frob'", "Frobnicate", "'com.example'")
    if where == "function":
        assert "'Wrap'" in err


# -- contrib ops ---------------------------------------------------------------------------------
CONTRIB_MODELS = [contrib.quantized_matmul, contrib.quantized_shared_matmuls, contrib.quantized_lstm,
                  contrib.quantized_qoperator_net, contrib.optimized_minilm,
                  functools.partial(contrib.optimized_minilm, gelu_approximation=True)]
CONTRIB_IDS = ["dynamic-quantize-matmul", "matmul-integer-to-float", "dynamic-quantize-lstm", "qoperator-net",
               "minilm-optimized", "minilm-optimized-fastgelu"]


def binding(model: contrib.ContribModel) -> list[str]:
    return [*(arg for name, shape in model.input_shapes.items()
              for arg in ("--input-shape", f"{name}=" + "x".join(map(str, shape)))),
            *(arg for name, size in model.dims.items() for arg in ("--dim", f"{name}={size}"))]


def feed_for(model: contrib.ContribModel) -> dict[str, np.ndarray]:
    if model.dims:
        return minilm_feed(model.dims["batch"], model.dims["seq"])
    return {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in model.input_shapes.items()}


@pytest.mark.parametrize("make", CONTRIB_MODELS, ids=CONTRIB_IDS)
def test_inspect_reports_static_shapes_of_contrib_models_once_bound(make):
    model = make()
    full = inspect_json(model.path, *binding(model))
    report = full["optimized"]
    assert report["unknown_shapes"] == []
    for tensor in report["inputs"] + report["outputs"]:
        assert all(isinstance(d, int) for d in tensor["shape"]), tensor
    for op in model.contrib_ops:
        assert f"com.microsoft::{op}" in full["source"]["op_counts"], full["source"]["op_counts"]


@pytest.mark.parametrize("make", CONTRIB_MODELS, ids=CONTRIB_IDS)
def test_contrib_shapes_are_the_shapes_onnxruntime_computes(make):
    """Every intermediate value: the inferred shape is the one onnxruntime produces for the feed."""
    model = make()
    graph = InferShapes(model.input_shapes, model.dims, require_static=True).run(load_model(model.path))
    inferred = {out.name: out.shape for node in graph.walk() for out in node.outputs}
    proto = onnx.load(model.path)
    listed = {o.name for o in proto.graph.output}
    proto.graph.output.extend(onnx.ValueInfoProto(name=name) for node in proto.graph.node for name in node.output
                              if name in inferred and name not in listed)
    ran = run_onnxruntime(proto, feed_for(model))
    compared = {name: (inferred[name], tuple(np.shape(ran[name]))) for name in ran if name in inferred}
    assert len(compared) >= len(proto.graph.node) // 2
    assert {name: a for name, (a, b) in compared.items() if a != b} == {}, compared


# Every contrib op these tools write compiles by expansion (tests/test_contrib_transformer.py,
# tests/test_contrib_quantized.py); one they never write still gets the one line naming it.
def test_compile_wasm_names_a_contrib_op_it_cannot_lower(tmp_path):
    node = helper.make_node("Inverse", ["x"], ["y"], name="invert", domain="com.microsoft")
    graph = helper.make_graph([node], "inverse", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3])])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)]), tmp_path / "m.onnx")
    cli_ok(["decompose", "--model-path", path, "--output-dir", tmp_path / "cus"])
    cli_ok(["build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "dag.json"])
    code, _, err = run_cli(["compile-wasm", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "wasm",
                            "--dag", tmp_path / "dag.json"])
    assert_one_line_error(code, err, "without a loop-nest lowering", "com.microsoft::Inverse (invert)",
                          "--fallback onnxruntime")
    assert not (tmp_path / "wasm").exists()


def contrib_node_model(op: str, inputs: dict[str, np.ndarray], constants: dict[str, np.ndarray],
                       order: list[str], **attrs) -> onnx.ModelProto:
    """One com.microsoft node over `order` (feeds and scale / zero-point constants), output y."""
    node = helper.make_node(op, order, ["y"], name=op.lower(), domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                                            v.shape) for k, v in inputs.items()],
                              [onnx.ValueInfoProto(name="y")],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


SCALE, ZERO = np.array(0.05, np.float32), np.array(3, np.uint8)
Q = {"xs": SCALE, "xz": ZERO, "ys": SCALE, "yz": ZERO}
U8 = lambda *shape: RNG.integers(0, 255, shape, dtype=np.uint8)  # noqa: E731
HAND_RULES = {
    "FusedMatMul-transA": ("FusedMatMul", {"a": RNG.standard_normal((2, 4, 3)).astype(np.float32),
                                           "b": RNG.standard_normal((2, 4, 5)).astype(np.float32)}, {},
                           ["a", "b"], {"transA": 1, "alpha": 0.5}),
    "FusedMatMul-transB": ("FusedMatMul", {"a": RNG.standard_normal((3, 4)).astype(np.float32),
                                           "b": RNG.standard_normal((2, 5, 4)).astype(np.float32)}, {},
                           ["a", "b"], {"transB": 1}),
    "QLinearLeakyRelu": ("QLinearLeakyRelu", {"x": U8(2, 3, 4)}, Q, ["x", "xs", "xz", "ys", "yz"], {"alpha": 0.1}),
    "QLinearSoftmax": ("QLinearSoftmax", {"x": U8(2, 7)}, Q, ["x", "xs", "xz", "ys", "yz"], {"axis": -1, "opset": 13}),
    "QLinearGlobalAveragePool": ("QLinearGlobalAveragePool", {"x": U8(1, 4, 5, 6)}, Q, ["x", "xs", "xz", "ys", "yz"],
                                 {"channels_last": 0}),
    "QLinearGlobalAveragePool-nhwc": ("QLinearGlobalAveragePool", {"x": U8(1, 5, 6, 4)}, Q,
                                      ["x", "xs", "xz", "ys", "yz"], {"channels_last": 1}),
    "QLinearConcat": ("QLinearConcat", {"a": U8(2, 3), "b": U8(2, 5)}, Q, ["ys", "yz", "a", "xs", "xz", "b", "xs", "xz"],
                      {"axis": 1}),
}


@pytest.mark.parametrize("case", HAND_RULES, ids=str)
def test_contrib_rules_cortex_adds_give_onnxruntimes_shapes(case):
    op, inputs, constants, order, attrs = HAND_RULES[case]
    model = contrib_node_model(op, inputs, constants, order, **attrs)
    graph = InferShapes(require_static=True).run(import_model(model))
    want = run_onnxruntime(model, inputs)["y"]
    assert (graph.outputs[0].shape, graph.outputs[0].dtype) == \
        (want.shape, helper.np_dtype_to_tensor_dtype(want.dtype))


def test_a_declared_zero_is_kept_where_inference_finds_nothing(tmp_path):
    """ConstantOfShape of an input's value: only the declared output shape [0] says how large it is,
    so a 0 on an output is a hint that inference overrides, never a loss of the only information."""
    graph = helper.make_graph([helper.make_node("ConstantOfShape", ["shape"], ["y"])], "zero",
                              [helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [0])])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "zero.onnx")
    report = inspect_json(path)
    assert report["optimized"]["outputs"][0]["shape"] == [0]


def _external_data_model(folder: Path, location: str) -> tuple[Path, np.ndarray]:
    """A MatMul whose weight lies in the file `location` beside the model (written there by onnx)."""
    w = np.random.default_rng(3).standard_normal((16, 8)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=0)
    return path, w


def test_external_data_behind_symbolic_links_loads_as_onnxruntime_loads_it(tmp_path):
    # A Hugging Face hub cache holds each file as a link to a content-addressed blob; onnx's own
    # loader refuses linked external data, onnxruntime follows the link.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir(), snapshot.mkdir()
    _, w = _external_data_model(blobs, "weights.bin")
    (blobs / "weights.bin").rename(blobs / "b1")
    (blobs / "model.onnx").rename(blobs / "b0")
    (snapshot / "model.onnx").symlink_to(blobs / "b0")
    (snapshot / "weights.bin").symlink_to(blobs / "b1")
    x = np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32)
    expected = ort.InferenceSession(str(snapshot / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = build_and_run(snapshot / "model.onnx", tmp_path, {"x": x})
    np.testing.assert_allclose(got["y"], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["y"], x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/passwd"])
def test_external_data_outside_the_model_s_folder_is_one_error(tmp_path, location):
    folder = tmp_path / "model"
    folder.mkdir()
    path, _ = _external_data_model(folder, "weights.bin")
    model = onnx.load(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    path.write_bytes(model.SerializeToString())
    code, _, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "'w'", location, "inside the model's folder")
    assert not (tmp_path / "cus").exists()


def test_external_data_past_the_end_of_its_file_is_one_error(tmp_path):
    path, _ = _external_data_model(tmp_path, "weights.bin")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 100)   # the weight needs 512 bytes
    code, _, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "'w'", "past the end", "weights.bin")
