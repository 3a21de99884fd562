"""decompose --parallel N: large contractions sliced along their output channels into N CUs of one
dag.json level, balanced by flops, with outputs equal to the unsliced model's (onnxruntime); only
where the cost model finds the slices worth their CUs and copies."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.registry import target
from cli_helpers import assert_one_line_error, run_cli
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag, validate_dag
from cortex.runtime import load
from ir.errors import CortexError
from ir.fs import write_bytes_atomically
from ir.onnx_import import load_model
from ir.ops import node_flops
from ir.options import from_text
from passes import optimize_pipeline, run_pipeline
from passes.fuse_groups import FuseGroups
from passes.parallel_slices import CU_OVERHEAD_FLOPS, MARGIN, MAX_OVERHEAD_SHARE, slicing_cost, worth_slicing
from passes.partition import PartitionIntoCUs
from testdata import run_onnxruntime

RNG = np.random.default_rng(0)
EVERY_OP = {"parallel_min_flops": 0, "parallel_cu_overhead_flops": 0}   # the cost model off: tiny ops slice too


def const(name, *shape):
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.1).astype(np.float32), name)


def save(tmp_path, nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], inits)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path, {n: RNG.standard_normal(s).astype(np.float32) for n, s in inputs}


def mlp(tmp_path, hidden_output: bool = True):
    """x -> MatMul + bias + Relu -> MatMul: a chain, no branch for threads to use. With
    `hidden_output` the Relu's result is a model output too, so each MatMul slices on its own;
    without, the two slice as a pair."""
    return save(tmp_path, [helper.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
                           helper.make_node("Add", ["a", "b1"], ["ab"], name="bias1"),
                           helper.make_node("Relu", ["ab"], ["r"], name="relu1"),
                           helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")],
                [("x", [32, 64])], ["y", *(["r"] if hidden_output else [])],
                [const("w1", 64, 128), const("b1", 128), const("w2", 128, 48)])


def build(tmp_path, path, **limits) -> tuple[dict, dict]:
    """decompose -> build-dag -> compile-wasm; (manifest, dag)."""
    decompose_model(path, tmp_path / "cus", PartitionIntoCUs(**{"min_cu_size": 0, **limits}))
    dag_path = tmp_path / "dag.json"
    dag = build_dag(tmp_path / "cus", dag_path)
    validate_dag(dag)
    write_bytes_atomically(dag_path, json.dumps(dag).encode())
    compile_cu_dir(target("wasm"), tmp_path / "cus", tmp_path / "wasm-bin", from_text(target("wasm").options),
                   dag_path, jobs=1)
    return json.loads((tmp_path / "cus" / "manifest.json").read_text()), json.loads(dag_path.read_text())


def assert_matches_onnxruntime(tmp_path, path, feeds, threads: int = 2) -> None:
    got = load(tmp_path / "dag.json", threads=threads, policy="strict").run(feeds)
    for name, want in run_onnxruntime(path, feeds).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5)


def level_of(dag: dict) -> dict[str, int]:
    return {cu: i for i, level in enumerate(dag["levels"]) for cu in level}


def test_each_large_matmul_becomes_two_slices_in_different_cus_of_one_level(tmp_path):
    path, feeds = mlp(tmp_path)
    manifest, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    slices = [cu for cu in dag["cus"] if "MatMul" in cu["op_types"]]
    assert len(slices) == 4                       # two MatMuls, two slices each, each its own CU
    levels = level_of(dag)
    first = [cu["id"] for cu in slices if "Relu" in cu["op_types"]]   # the epilogue splits with it
    second = [cu["id"] for cu in slices if "Relu" not in cu["op_types"]]
    assert len(first) == len(second) == 2
    assert levels[first[0]] == levels[first[1]] and levels[second[0]] == levels[second[1]]
    assert manifest["options"]["parallel"] == 2
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_slices_are_balanced_by_flops(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                       [("x", [16, 32])], ["y"], [const("w", 32, 90)])
    _, dag = build(tmp_path, path, parallel=3, **EVERY_OP)
    flops = [cu["flops"] for cu in dag["cus"] if cu["op_types"] == ["MatMul"]]
    assert len(flops) == 3 and max(flops) == min(flops)        # 30 output channels each
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_conv_and_gemm_slice_along_output_channels(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                                  helper.make_node("Relu", ["c"], ["r"], name="relu"),
                                  helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
                                  helper.make_node("Gemm", ["f", "wg", "bg"], ["y"], name="gemm", transB=1)],
                       [("x", [1, 3, 8, 8])], ["y"],
                       [const("w", 8, 3, 3, 3), const("b", 8), const("wg", 10, 512), const("bg", 10)])
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    levels = level_of(dag)
    for op in ("Conv", "Gemm"):
        ids = [cu["id"] for cu in dag["cus"] if op in cu["op_types"]]
        assert len(ids) == 2 and levels[ids[0]] == levels[ids[1]], (op, dag["levels"])
    assert_matches_onnxruntime(tmp_path, path, feeds)


@pytest.mark.parametrize("stride, pads, kernel", [(1, [1, 1, 1, 1], 3), (2, [1, 1, 1, 1], 3), (1, [2, 2, 2, 2], 5),
                                                  (2, [3, 3, 2, 2], 7), (1, [2, 1, 0, 1], 3)])
def test_a_wide_conv_slices_along_its_output_rows(tmp_path, stride, pads, kernel):
    # 16 rows of 16 columns: each half keeps 128 output columns, so the rows split (each slice packs
    # the im2col of its own rows, not the whole input's); the bias and Relu split with it.
    path, feeds = save(tmp_path, [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=pads,
                                                   strides=[stride, stride]),
                                  helper.make_node("Relu", ["c"], ["y"], name="relu")],
                       [("x", [1, 4, 16 * stride, 16 * stride])], ["y"], [const("w", 8, 4, kernel, kernel), const("b", 8)])
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    convs = [cu for cu in dag["cus"] if "Conv" in cu["op_types"]]
    assert len(convs) == 2 and all({"Slice", "Relu"} <= set(cu["op_types"]) for cu in convs)
    levels = level_of(dag)
    assert levels[convs[0]["id"]] == levels[convs[1]["id"]]
    rows = [dag["tensors"][cu["outputs"][0]]["shape"] for cu in convs]
    assert sum(shape[2] for shape in rows) == (16 * stride + pads[0] + pads[2] - kernel) // stride + 1
    assert all(shape[1] == 8 for shape in rows)               # every slice computes all channels
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_a_1x1_conv_after_a_row_sliced_conv_reads_its_row_slices_with_no_concat_between(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
                                  helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
                                  helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
                                  helper.make_node("Relu", ["c2"], ["y"], name="relu2")],
                       [("x", [1, 4, 16, 16])], ["y"], [const("w1", 8, 4, 3, 3), const("b1", 8), const("w2", 6, 8, 1, 1)])
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    ops = [op for cu in dag["cus"] for op in cu["op_types"]]
    assert ops.count("Concat") == 1 and ops.count("Slice") == 2      # the one join after conv2; conv1's Slices
    convs = [cu for cu in dag["cus"] if "Conv" in cu["op_types"]]
    levels = level_of(dag)
    assert len({levels[cu["id"]] for cu in convs}) == len(convs) // 2   # slice k of each level side by side
    assert_matches_onnxruntime(tmp_path, path, feeds)


@pytest.mark.parametrize("size, kernel", [(6, 3), (16, 1)])
def test_a_narrow_or_1x1_conv_slices_along_its_output_channels(tmp_path, size, kernel):
    # 6x6: 3 rows x 6 columns a half, too few; a 1x1 Conv's im2col is its input, too little to repack.
    path, feeds = save(tmp_path, [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[kernel // 2] * 4)],
                       [("x", [1, 4, size, size])], ["y"], [const("w", 8, 4, kernel, kernel)])
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    convs = [cu for cu in dag["cus"] if "Conv" in cu["op_types"]]
    assert len(convs) == 2 and not any("Slice" in cu["op_types"] for cu in convs)
    assert [dag["tensors"][cu["outputs"][0]]["shape"][1] for cu in convs] == [4, 4]
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_a_grouped_conv_slices_whole_groups(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("Conv", ["x", "w"], ["y"], name="dw", group=4, pads=[1, 1, 1, 1])],
                       [("x", [1, 4, 6, 6])], ["y"], [const("w", 4, 1, 3, 3)])
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    assert sum("Conv" in cu["op_types"] for cu in dag["cus"]) == 2
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_contractions_under_the_threshold_stay_whole(tmp_path):
    path, feeds = mlp(tmp_path)
    flops_mm1 = 2 * 32 * 64 * 128
    _, dag = build(tmp_path, path, parallel=2, parallel_min_flops=flops_mm1,   # mm2 has fewer flops
                   parallel_cu_overhead_flops=0)
    matmuls = [cu for cu in dag["cus"] if "MatMul" in cu["op_types"]]
    assert sum(cu["op_types"].count("MatMul") for cu in matmuls) == 3
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_parallel_one_changes_nothing(tmp_path):
    path, _ = mlp(tmp_path)
    decompose_model(path, tmp_path / "a", PartitionIntoCUs(min_cu_size=0))
    decompose_model(path, tmp_path / "b", PartitionIntoCUs(min_cu_size=0, parallel=1, **EVERY_OP))
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()
    assert "parallel" not in json.loads((tmp_path / "a" / "manifest.json").read_text())["options"]


def test_max_cu_size_slices_are_not_sliced_again(tmp_path):
    path, feeds = mlp(tmp_path)
    manifest, _ = build(tmp_path, path, parallel=2, **EVERY_OP, max_cu_size=3000)
    assert all(cu["params"] <= 3000 for cu in manifest["cus"])
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_parallel_below_one_is_refused():
    with pytest.raises(CortexError, match="--parallel must be at least 1"):
        PartitionIntoCUs(parallel=0)


def test_decompose_parallel_cli(tmp_path):
    path, _ = mlp(tmp_path)
    code, out, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "cus", "--parallel", "2",
                              "--parallel-min-flops", "0", "--parallel-cu-overhead-flops", "0", "--json"])
    assert code == 0, err
    assert json.loads(out)["sliced_ops"] == 2
    code, _, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "bad", "--parallel", "0"])
    assert_one_line_error(code, err, "--parallel must be at least 1")
    assert not (tmp_path / "bad").exists()


def conv_stack(tmp_path, channels: int, size: int, kernel: int, depth: int):
    """x -> (Conv + Relu) x depth at one width: a stack like shufflenet's or resnet's stages."""
    nodes, inits, x = [], [], "x"
    for i in range(depth):
        nodes += [helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}", pads=[kernel // 2] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        inits += [const(f"w{i}", channels, channels, kernel, kernel), const(f"b{i}", channels)]
        x = f"r{i}"
    return save(tmp_path, nodes, [("x", [1, channels, size, size])], [x], inits)


def test_many_small_convolutions_are_not_sliced(tmp_path):
    # Each 1x1 conv is 6.4 MFLOP, over --parallel-min-flops; half of it is less than twice what the
    # two CUs and 0.6 MB of copies slicing it adds cost, so the CU count stays (the flat threshold
    # sliced them all).
    path, _ = conv_stack(tmp_path, 64, 28, 1, 8)
    sliced = decompose_model(path, tmp_path / "sliced", PartitionIntoCUs(min_cu_size=0, parallel=2))
    whole = decompose_model(path, tmp_path / "whole", PartitionIntoCUs(min_cu_size=0))
    assert sliced["sliced_ops"] == 0 and sliced["cus"] == whole["cus"]
    manifest = json.loads((tmp_path / "sliced" / "manifest.json").read_text())
    assert manifest["options"]["parallel_cu_overhead_flops"] == CU_OVERHEAD_FLOPS


def test_a_large_matmul_is_sliced_and_matches_onnxruntime(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
                                  helper.make_node("Relu", ["a"], ["y"], name="relu")],
                       [("x", [128, 384])], ["y"], [const("w", 384, 384)])    # 37.7 MFLOP: MiniLM's projections
    _, dag = build(tmp_path, path, parallel=2)
    assert [cu["op_types"] for cu in dag["cus"]].count(["MatMul", "Relu"]) == 2
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_slicing_adds_at_most_a_quarter_of_the_models_flops_in_overhead(tmp_path):
    # In four, every 3x3 conv here is worth slicing alone (22.6 MFLOP: 16.9 M saved, 6.6 M of four
    # CUs and copies), but not all eight: the most profitable go first, until the budget is spent.
    path, _ = conv_stack(tmp_path, 40, 28, 3, 8)
    graph, _ = run_pipeline(load_model(path), [*optimize_pipeline({}, {}, require_static=True), FuseGroups()])
    total = sum(node_flops(n) for n in graph.nodes)
    alone = [slicing_cost(node, 4, CU_OVERHEAD_FLOPS) for node in graph.nodes if node.op_type == "Conv"]
    assert len(alone) == 8 and all(saved >= MARGIN * cost for saved, cost in alone)
    chosen = worth_slicing(graph, 4, 0)
    assert 0 < len(chosen) < len(alone)
    assert sum(c.cost for c in chosen) <= MAX_OVERHEAD_SHARE * total


def test_cli_refuses_a_negative_cu_overhead(tmp_path):
    path, _ = mlp(tmp_path)
    code, _, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "bad", "--parallel", "2",
                            "--parallel-cu-overhead-flops", "-1"])
    assert_one_line_error(code, err, "--parallel-cu-overhead-flops must not be negative")
    assert not (tmp_path / "bad").exists()


def test_two_matmuls_in_a_row_slice_as_a_pair_joined_once_by_a_sum(tmp_path):
    # Slice k: x @ w1[:, k] + b1[k] -> Relu -> @ w2[k, :]; the partial products meet in one Sum.
    path, feeds = save(tmp_path, [helper.make_node("MatMul", ["x", "w1"], ["a"], name="up"),
                                  helper.make_node("Add", ["a", "b1"], ["ab"], name="bias1"),
                                  helper.make_node("Relu", ["ab"], ["r"], name="relu1"),
                                  helper.make_node("MatMul", ["r", "w2"], ["d"], name="down"),
                                  helper.make_node("Add", ["d", "b2"], ["y"], name="bias2")],
                       [("x", [32, 64])], ["y"], [const("w1", 64, 128), const("b1", 128), const("w2", 128, 64),
                                                  const("b2", 64)])
    manifest, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    slices = [cu for cu in dag["cus"] if "MatMul" in cu["op_types"]]
    assert len(slices) == 2 and all("Relu" in cu["op_types"] for cu in slices)
    assert level_of(dag)[slices[0]["id"]] == level_of(dag)[slices[1]["id"]]
    assert not any("Concat" in cu["op_types"] for cu in dag["cus"])
    (join,) = [cu for cu in dag["cus"] if "Sum" in cu["op_types"]]
    assert "Add" in join["op_types"]                  # the second bias is added once, after the Sum
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_a_feed_forward_block_with_gelu_slices_as_a_pair(tmp_path):
    # The erf GELU reads its input twice (x * (1 + erf(x / sqrt 2)) / 2): it splits with the first
    # MatMul all the same, so each slice runs up-projection, GELU and down-projection.
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"], name="up"),
             helper.make_node("Add", ["a", "b1"], ["h"], name="bias1"),
             helper.make_node("Div", ["h", "sqrt2"], ["hs"], name="scale"),
             helper.make_node("Erf", ["hs"], ["e"], name="erf"),
             helper.make_node("Add", ["e", "one"], ["e1"], name="plus1"),
             helper.make_node("Mul", ["h", "e1"], ["g"], name="gate"),
             helper.make_node("Mul", ["g", "half"], ["gelu"], name="halve"),
             helper.make_node("MatMul", ["gelu", "w2"], ["d"], name="down"),
             helper.make_node("Add", ["d", "x"], ["y"], name="residual")]
    scalars = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
               (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    path, feeds = save(tmp_path, nodes, [("x", [16, 32])], ["y"],
                       [const("w1", 32, 128), const("b1", 128), const("w2", 128, 32), *scalars])
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    slices = [cu for cu in dag["cus"] if "MatMul" in cu["op_types"]]
    assert len(slices) == 2 and all("Erf" in cu["op_types"] for cu in slices)
    assert not any("Concat" in cu["op_types"] for cu in dag["cus"])
    assert_matches_onnxruntime(tmp_path, path, feeds)
