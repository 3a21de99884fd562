"""Each graph pass on the smallest model that shows it, checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ir.onnx_export import export_model
from ir.onnx_import import import_model
from passes import (EliminateCommonSubexpressions, EliminateDeadCode, FoldConstants, InferShapes, Simplify,
                    optimize_pipeline, run_pipeline)


def make_model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def optimize(model, passes):
    graph, _ = run_pipeline(import_model(model), passes)
    exported = export_model(graph)
    onnx.checker.check_model(exported, full_check=True)
    return graph, exported


def assert_same_outputs(original, optimized, feeds):
    for a, b in zip(run_ort(original, feeds), run_ort(optimized, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=0)


def tensor(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def test_shape_subgraph_folds_to_a_constant_reshape():
    # y = Reshape(x, Concat(Gather(Shape(x), 0), [-1])): the MiniLM-style dynamic reshape.
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
             helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, ["n", 3, 4])], [tensor("y", TensorProto.FLOAT, None)], inits)
    graph, exported = optimize(model, optimize_pipeline(dims={"n": 2}, require_static=True))
    assert [n.op_type for n in graph.nodes] == ["Reshape"]
    assert graph.outputs[0].shape == (2, 12)
    assert graph.nodes[0].inputs[1].const.tolist() == [2, -1]
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    assert_same_outputs(model, exported, {"x": x})


def test_constant_of_shape_weights_are_folded_into_parameters():
    nodes = [helper.make_node("ConstantOfShape", ["wshape"], ["w"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    inits = [helper.make_tensor("wshape", TensorProto.INT64, [2], [4, 3])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [2, 4])], [tensor("y", TensorProto.FLOAT, [2, 3])], inits)
    graph, exported = optimize(model, [InferShapes(), FoldConstants()])
    assert [n.op_type for n in graph.nodes] == ["MatMul"]
    assert graph.param_count() == 12
    assert_same_outputs(model, exported, {"x": np.ones((2, 4), np.float32)})


def test_random_ops_are_never_folded_or_merged():
    nodes = [helper.make_node("RandomNormal", [], ["r1"], shape=[2], seed=1.0),
             helper.make_node("RandomNormal", [], ["r2"], shape=[2], seed=1.0),
             helper.make_node("Add", ["r1", "r2"], ["y"])]
    model = make_model(nodes, [], [tensor("y", TensorProto.FLOAT, [2])])
    graph, _ = optimize(model, [FoldConstants(), EliminateCommonSubexpressions()])
    assert [n.op_type for n in graph.nodes] == ["RandomNormal", "RandomNormal", "Add"]


def test_dead_code_is_removed_and_outputs_kept():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Exp", ["x"], ["unused"]),
             helper.make_node("Log", ["unused"], ["unused2"])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [3])], [tensor("y", TensorProto.FLOAT, [3])])
    graph, _ = optimize(model, [EliminateDeadCode()])
    assert [n.op_type for n in graph.nodes] == ["Relu"]


def test_common_subexpressions_and_equal_constants_merge():
    nodes = [helper.make_node("Add", ["x", "c1"], ["a"]), helper.make_node("Add", ["x", "c2"], ["b"]),
             helper.make_node("Mul", ["a", "b"], ["y"])]
    inits = [helper.make_tensor("c1", TensorProto.FLOAT, [3], [1, 2, 3]),
             helper.make_tensor("c2", TensorProto.FLOAT, [3], [1, 2, 3])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [3])], [tensor("y", TensorProto.FLOAT, [3])], inits)
    graph, exported = optimize(model, [EliminateCommonSubexpressions(), EliminateDeadCode()])
    assert [n.op_type for n in graph.nodes] == ["Add", "Mul"]
    assert graph.nodes[1].inputs[0] is graph.nodes[1].inputs[1]
    assert_same_outputs(model, exported, {"x": np.array([1, -2, 3], np.float32)})


def test_merged_graph_outputs_keep_their_names():
    nodes = [helper.make_node("Relu", ["x"], ["y1"]), helper.make_node("Relu", ["x"], ["y2"])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [3])],
                       [tensor("y1", TensorProto.FLOAT, [3]), tensor("y2", TensorProto.FLOAT, [3])])
    graph, exported = optimize(model, [EliminateCommonSubexpressions()])
    assert [o.name for o in exported.graph.output] == ["y1", "y2"]
    assert_same_outputs(model, exported, {"x": np.array([1, -2, 3], np.float32)})


def test_identity_dropout_and_noop_reshape_are_removed():
    nodes = [helper.make_node("Identity", ["x"], ["a"]),
             helper.make_node("Dropout", ["a"], ["b"], ratio=0.5),
             helper.make_node("Reshape", ["b", "same"], ["c"]),
             helper.make_node("Cast", ["c"], ["d"], to=TensorProto.FLOAT),
             helper.make_node("Relu", ["d"], ["y"])]
    inits = [helper.make_tensor("same", TensorProto.INT64, [2], [2, 3])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [2, 3])], [tensor("y", TensorProto.FLOAT, [2, 3])], inits, opset=11)
    graph, exported = optimize(model, [InferShapes(), Simplify(), EliminateDeadCode()])
    assert [n.op_type for n in graph.nodes] == ["Relu"]
    assert_same_outputs(model, exported, {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 2})


def test_identity_between_input_and_output_stays():
    model = make_model([helper.make_node("Identity", ["x"], ["y"])], [tensor("x", TensorProto.FLOAT, [3])],
                       [tensor("y", TensorProto.FLOAT, [3])])
    graph, exported = optimize(model, [Simplify()])
    assert [n.op_type for n in graph.nodes] == ["Identity"]
    assert [o.name for o in exported.graph.output] == ["y"]


def test_identity_before_output_renames_the_producer():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [3])], [tensor("y", TensorProto.FLOAT, [3])])
    graph, exported = optimize(model, [Simplify()])
    assert [(n.op_type, n.outputs[0].name) for n in graph.nodes] == [("Relu", "y")]
    assert_same_outputs(model, exported, {"x": np.array([1, -2, 3], np.float32)})


def test_transpose_pairs_cancel_or_compose():
    nodes = [helper.make_node("Transpose", ["x"], ["t1"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["t2"], ["t3"], perm=[2, 0, 1]),
             helper.make_node("Transpose", ["t3"], ["y"], perm=[0, 2, 1])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [2, 3, 4])], [tensor("y", TensorProto.FLOAT, None)])
    graph, exported = optimize(model, [InferShapes(), Simplify(), EliminateDeadCode()])
    assert [(n.op_type, n.attrs.get("perm")) for n in graph.nodes] == [("Transpose", [2, 1, 0])]
    assert_same_outputs(model, exported, {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4)})


def test_passes_are_small_named_objects():
    names = [p.name for p in optimize_pipeline()]
    assert names == ["expand-ops", "infer-shapes", "fold-constants", "fold-qdq", "simplify", "eliminate-common-subexpressions",
                     "fold-constants", "eliminate-dead-code", "hoist-scalar-operands"]


def _gelu_after_matmul(extra_reader: str | None = None):
    """MatMul -> Add(bias) -> x * 0.5 * (1 + erf(x / sqrt 2)), the diamond exporters write for GELU;
    `extra_reader` names an intermediate that a Neg outside the diamond also reads."""
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["mm"]), n("Add", ["mm", "b"], ["a"]),
             n("Div", ["a", "sqrt2"], ["d"]), n("Erf", ["d"], ["e"]), n("Add", ["e", "one"], ["p"]),
             n("Mul", ["a", "p"], ["m"]), n("Mul", ["m", "half"], ["g"]), n("Relu", ["g"], ["y"])]
    outputs = [tensor("y", TensorProto.FLOAT, [4, 6])]
    if extra_reader:
        nodes.append(n("Neg", [extra_reader], ["z"]))
        outputs.append(tensor("z", TensorProto.FLOAT, [4, 6]))
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [5, 6], np.ones(30)),
             helper.make_tensor("b", TensorProto.FLOAT, [6], np.ones(6)),
             helper.make_tensor("sqrt2", TensorProto.FLOAT, [], [2 ** 0.5]),
             helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])]
    graph = import_model(make_model(nodes, [tensor("x", TensorProto.FLOAT, [4, 5])], outputs, inits))
    from passes.fuse_groups import assign_fusion_groups
    assign_fusion_groups(graph)
    return {node.outputs[0].name: node.fusion_group for node in graph.nodes}


def test_a_gelu_diamond_joins_the_fusion_group_of_its_matmul():
    groups = _gelu_after_matmul()
    assert groups["mm"] is not None
    assert all(groups[v] == groups["mm"] for v in ("a", "d", "e", "p", "m", "g", "y"))


def test_a_group_ends_where_an_inner_value_is_read_outside_it():
    groups = _gelu_after_matmul(extra_reader="e")
    # Erf's output leaves the group, so the diamond cannot close: the group is MatMul -> Add only
    assert groups["mm"] is not None and groups["a"] == groups["mm"]
    assert all(groups[v] != groups["mm"] for v in ("d", "e", "p", "m", "g", "y", "z"))
    groups = _gelu_after_matmul(extra_reader="g")
    # the sink itself may be read anywhere: the group stops at g, the Relu is not in it
    assert all(groups[v] == groups["mm"] for v in ("a", "d", "e", "p", "m", "g"))
    assert groups["y"] != groups["mm"]


def _residual_block(add_inputs=("c", "s"), shortcut_shape=(1, 4, 5, 5), op="Add", shortcut_from_conv=False):
    """Conv -> Add(c, shortcut) -> Relu, resnet's block end; the shortcut a model input, or computed
    from the Conv's own output (so the Add cannot join without making the group non-convex)."""
    n = helper.make_node
    nodes = [n("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])]
    if shortcut_from_conv:
        nodes.append(n("MaxPool", ["c"], ["s"], kernel_shape=[1, 1]))
    nodes += [n(op, list(add_inputs), ["a"]), n("Relu", ["a"], ["y"])]
    inputs = [tensor("x", TensorProto.FLOAT, [1, 3, 5, 5])]
    if not shortcut_from_conv:
        inputs.append(tensor("s", TensorProto.FLOAT, list(shortcut_shape)))
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], np.ones(108))]
    return _fusion_groups(make_model(nodes, inputs, [tensor("y", TensorProto.FLOAT, [1, 4, 5, 5])], inits))


def _fusion_groups(model) -> dict:
    """Output name -> fusion group, after the optimizing passes (which infer the shapes)."""
    from passes.fuse_groups import FuseGroups
    graph, _ = run_pipeline(import_model(model), [*optimize_pipeline(require_static=True), FuseGroups()])
    return {node.outputs[0].name: node.fusion_group for node in graph.nodes}


@pytest.mark.parametrize("op,add_inputs", [("Add", ("c", "s")), ("Add", ("s", "c")), ("Sum", ("s", "c"))])
def test_a_residual_add_and_its_relu_join_the_group_of_their_conv(op, add_inputs):
    groups = _residual_block(add_inputs, op=op)
    assert groups["c"] is not None and groups["a"] == groups["c"] and groups["y"] == groups["c"]


def test_an_add_of_a_broadcast_operand_does_not_join_as_a_residual():
    groups = _residual_block(shortcut_shape=(1, 1, 5, 5))
    assert groups["a"] != groups["c"] and groups["y"] != groups["c"]


def test_a_residual_computed_from_the_anchor_outside_the_group_does_not_join():
    """Conv -> MaxPool -> Add(Conv, MaxPool): with the Add in the Conv's group, the path through the
    MaxPool would leave the group and come back."""
    groups = _residual_block(shortcut_from_conv=True)
    assert groups["a"] != groups["c"]


def test_a_group_takes_at_most_one_residual_add():
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["mm"]), n("Add", ["mm", "r1"], ["a1"]), n("Add", ["a1", "r2"], ["a2"])]
    shape = [4, 6]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [4, 5]), tensor("r1", TensorProto.FLOAT, shape),
                               tensor("r2", TensorProto.FLOAT, shape)], [tensor("a2", TensorProto.FLOAT, shape)],
                       [helper.make_tensor("w", TensorProto.FLOAT, [5, 6], np.ones(30))])
    groups = _fusion_groups(model)
    assert groups["mm"] is not None and groups["a1"] == groups["mm"] and groups["a2"] != groups["mm"]


def test_partitioning_keeps_a_residual_group_whole_and_its_shortcut_before_it():
    """resnet's downsampling block: the main branch's last Conv and the shortcut's Conv both read
    the block input and meet at the Add; whatever the cap, the group (a Conv, the Add, the Relu)
    lands in one CU, and the CUs still run in an order that computes the model."""
    from passes.fuse_groups import FuseGroups
    from passes.partition import partition_graph
    n = helper.make_node
    rng = np.random.default_rng(2)
    nodes = [n("Conv", ["x", "w1"], ["main"], pads=[1, 1, 1, 1], name="main"),
             n("Conv", ["x", "w2"], ["short"], name="short"),
             n("Add", ["main", "short"], ["a"], name="add"), n("Relu", ["a"], ["y"], name="relu")]
    inits = [helper.make_tensor("w1", TensorProto.FLOAT, [8, 8, 3, 3], rng.standard_normal(576).astype(np.float32)),
             helper.make_tensor("w2", TensorProto.FLOAT, [8, 8, 1, 1], rng.standard_normal(64).astype(np.float32))]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [1, 8, 5, 5])], [tensor("y", TensorProto.FLOAT, [1, 8, 5, 5])],
                       inits)
    graph, _ = run_pipeline(import_model(model), [*optimize_pipeline(require_static=True), FuseGroups()])
    label = {node.name: node.fusion_group for node in graph.nodes}
    assert label["add"] is not None and label["relu"] == label["add"]
    assert label["add"] in (label["main"], label["short"])
    for cap in (576, 640, 1000):
        part = partition_graph(graph, min_cu_size=0, max_cu_size=cap, max_cu_depth=1)
        cu_of = {node.name: i for i, cu in enumerate(part.cus) for node in cu.nodes}
        assert len({cu_of[name] for name, group in label.items() if group == label["add"]}) == 1
        anchor = next(name for name in ("main", "short") if label[name] == label["add"])
        other = "short" if anchor == "main" else "main"
        assert cu_of[other] <= cu_of[anchor]  # the residual's CU runs first (or is the same CU)


def test_a_split_matmul_splits_its_gelu_diamond_with_it():
    """A MatMul too large for one CU splits along its columns. The diamond reads the MatMul's output
    twice, both times a split result, so each slice carries its own GELU and the slices meet once,
    after it; the graph still computes the same."""
    from passes.fuse_groups import FuseGroups
    from passes.split_large_ops import split_large_ops
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["mm"]), n("Div", ["mm", "sqrt2"], ["d"]), n("Erf", ["d"], ["e"]),
             n("Add", ["e", "one"], ["p"]), n("Mul", ["mm", "p"], ["m"]), n("Mul", ["m", "half"], ["y"])]
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [5, 8], rng.standard_normal(40).astype(np.float32)),
             helper.make_tensor("sqrt2", TensorProto.FLOAT, [], [2 ** 0.5]),
             helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [3, 5])], [tensor("y", TensorProto.FLOAT, [3, 8])], inits)
    graph, _ = run_pipeline(import_model(model), [*optimize_pipeline(require_static=True), FuseGroups()])
    assert len({node.fusion_group for node in graph.nodes}) == 1
    assert split_large_ops(graph, max_params=20) == 1
    slices = sum(node.op_type == "MatMul" for node in graph.nodes)
    assert slices >= 2 and sum(node.op_type == "Erf" for node in graph.nodes) == slices
    (join,) = [node for node in graph.nodes if node.op_type == "Concat"]
    assert join.outputs[0].name == "y" or any(v.name == "y" for v in join.outputs)
    exported = export_model(graph)
    onnx.checker.check_model(exported, full_check=True)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    assert_same_outputs(model, exported, {"x": x})


def test_per_channel_scale_and_shift_after_a_batch_norm_fold_into_it():
    """Caffe2's BN -> Mul(per-channel) -> Add(per-channel) -> Relu (densenet121) becomes BN -> Relu,
    and a BN -> Relu forms a fusion group; the folded graph computes the same."""
    from passes.fuse_groups import FuseGroups
    n = helper.make_node
    rng = np.random.default_rng(1)
    nodes = [n("BatchNormalization", ["x", "s", "b", "m", "v"], ["bn"], epsilon=1e-3),
             n("Mul", ["bn", "c"], ["scaled"]), n("Add", ["a", "scaled"], ["shifted"]), n("Relu", ["shifted"], ["y"])]
    consts = {"s": (4,), "b": (4,), "m": (4,), "v": (4,), "c": (4, 1, 1), "a": (1, 4, 1, 1)}
    inits = [helper.make_tensor(k, TensorProto.FLOAT, shape, (np.abs(rng.standard_normal(shape)) + 0.1).ravel())
             for k, shape in consts.items()]
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [2, 4, 3, 5])], [tensor("y", TensorProto.FLOAT, [2, 4, 3, 5])],
                       inits)
    graph, exported = optimize(model, [*optimize_pipeline(require_static=True), FuseGroups()])
    assert [node.op_type for node in graph.nodes] == ["BatchNormalization", "Relu"]
    assert graph.nodes[0].fusion_group is not None and graph.nodes[0].fusion_group == graph.nodes[1].fusion_group
    assert_same_outputs(model, exported, {"x": rng.standard_normal((2, 4, 3, 5)).astype(np.float32)})


def test_a_scale_that_is_not_per_channel_stays_after_the_batch_norm():
    from passes.fuse_groups import FuseGroups
    n = helper.make_node
    nodes = [n("BatchNormalization", ["x", "s", "b", "m", "v"], ["bn"]), n("Mul", ["bn", "c"], ["y"])]
    inits = [helper.make_tensor(k, TensorProto.FLOAT, [4], np.ones(4)) for k in "sbmv"]
    inits.append(helper.make_tensor("c", TensorProto.FLOAT, [5], np.arange(5.0)))   # along the last axis
    model = make_model(nodes, [tensor("x", TensorProto.FLOAT, [1, 4, 3, 5])], [tensor("y", TensorProto.FLOAT, [1, 4, 3, 5])],
                       inits)
    graph, _ = optimize(model, [*optimize_pipeline(require_static=True), FuseGroups()])
    assert [node.op_type for node in graph.nodes] == ["BatchNormalization", "Mul"]
