"""Fusion (Conv + BatchNormalization folding, epilogue groups) and splitting ops whose weights
exceed --max-cu-size along their output channels, each on the smallest model that shows it."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cortex.commands.decompose import decompose_model
from cortex.dag import build_dag, validate_dag
from cortex.tools.onnx_reference import run_dag
from ir.errors import CortexError
from testdata import run_onnxruntime
from passes.partition import PartitionIntoCUs

RNG = np.random.default_rng(0)


def const(name, *shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def save(tmp_path, nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], inits)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    feeds = {n: RNG.standard_normal(s).astype(np.float32) for n, s in inputs}
    return path, feeds


def decompose_and_compare(tmp_path, path, feeds, **limits) -> dict:
    limits = dict(dict(min_cu_size=0, max_cu_size=1_000_000, max_cu_depth=3), **limits)
    decompose_model(path, tmp_path / "cus", PartitionIntoCUs(**limits))
    dag = build_dag(tmp_path / "cus", tmp_path / "dag.json")
    validate_dag(dag)
    (tmp_path / "dag.json").write_text(json.dumps(dag))
    got, expected = run_dag(tmp_path / "dag.json", feeds), run_onnxruntime(path, feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)
    manifest = json.loads((tmp_path / "cus" / "manifest.json").read_text())
    assert all(cu["params"] <= limits["max_cu_size"] for cu in manifest["cus"])
    return manifest


def op_types(manifest) -> list[str]:
    return [op for cu in manifest["cus"] for op in cu["op_types"]]


def test_a_matmul_too_large_for_one_cu_is_split_along_output_channels_with_its_epilogue(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                                  helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
                                  helper.make_node("Relu", ["hb"], ["y"], name="relu")],
                       [("x", [2, 16])], ["y"], [const("w", 16, 64), const("b", 64)])
    manifest = decompose_and_compare(tmp_path, path, feeds, max_cu_size=300, max_cu_depth=1)
    pieces = [cu for cu in manifest["cus"] if "MatMul" in cu["op_types"]]
    assert len(pieces) == 4  # 16 + 1 parameters per channel, 17 channels per CU at most
    assert all(cu["op_types"] == ["Add", "MatMul", "Relu"] for cu in pieces), "the epilogue splits with it"
    assert op_types(manifest).count("Concat") == 1


def test_a_gemm_with_transposed_weight_and_bias_splits(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="gemm", transB=1)],
                       [("x", [3, 8])], ["y"], [const("w", 40, 8), const("c", 40)])
    manifest = decompose_and_compare(tmp_path, path, feeds, max_cu_size=100)
    assert op_types(manifest).count("Gemm") == 4


def test_an_epilogue_reading_another_tensor_stays_after_the_join(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                                  helper.make_node("Add", ["h", "x"], ["r"], name="residual"),
                                  helper.make_node("Sigmoid", ["r"], ["y"], name="act")],
                       [("x", [4, 32])], ["y"], [const("w", 32, 32)])
    manifest = decompose_and_compare(tmp_path, path, feeds, max_cu_size=600)
    joined = [cu for cu in manifest["cus"] if "Concat" in cu["op_types"]]
    assert len(joined) == 1 and "Add" in joined[0]["op_types"] or any(
        "Add" in cu["op_types"] and "MatMul" not in cu["op_types"] for cu in manifest["cus"])


def test_conv_batchnorm_is_folded_and_the_conv_split(tmp_path):
    channels = 12
    inits = [const("w", channels, 3, 3, 3), const("b", channels),
             numpy_helper.from_array(RNG.uniform(0.5, 2, channels).astype(np.float32), "scale"),
             const("shift", channels), const("mean", channels),
             numpy_helper.from_array(RNG.uniform(0.5, 2, channels).astype(np.float32), "var")]
    path, feeds = save(tmp_path, [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                                  helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"],
                                                   name="bn"),
                                  helper.make_node("Relu", ["n"], ["y"], name="relu")],
                       [("x", [1, 3, 8, 8])], ["y"], inits)
    manifest = decompose_and_compare(tmp_path, path, feeds, max_cu_size=200)
    assert "BatchNormalization" not in op_types(manifest)
    assert op_types(manifest).count("Conv") == 2  # 28 parameters per channel: 12 channels as 2 x 6


def test_fusion_groups_are_listed_and_never_cut_even_at_depth_one(tmp_path):
    path, feeds = save(tmp_path, [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                                  helper.make_node("Add", ["c", "b"], ["cb"], name="bias"),
                                  helper.make_node("Relu", ["cb"], ["y"], name="relu")],
                       [("x", [1, 3, 8, 8])], ["y"], [const("w", 4, 3, 3, 3), const("b", 1, 4, 1, 1)])
    manifest = decompose_and_compare(tmp_path, path, feeds, max_cu_depth=1)
    assert len(manifest["cus"]) == 1
    assert manifest["cus"][0]["fusion_groups"] == [["conv", "bias", "relu"]]
    assert manifest["cus"][0]["depth"] == 1


def test_one_output_channel_larger_than_the_cap_is_a_clear_error(tmp_path):
    path, _ = save(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                   [("x", [1, 64])], ["y"], [const("w", 64, 8)])
    with pytest.raises(CortexError, match=r"node 'mm' \(MatMul\): one output channel needs 64 parameters, more than "
                                          r"--max-cu-size 10"):
        decompose_model(path, tmp_path / "cus", PartitionIntoCUs(min_cu_size=0, max_cu_size=10, max_cu_depth=3))
    assert not (tmp_path / "cus").exists()


@pytest.mark.parametrize("opset", [9, 17])  # Slice takes attributes before opset 10, inputs after
def test_a_grouped_conv_splits_along_whole_groups_or_inside_one(tmp_path, opset):
    # 4 groups of 3 output channels, 2 input channels each: 18 parameters per output channel.
    path, feeds = save(tmp_path, [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="grouped", group=4)],
                       [("x", [1, 8, 6, 6])], ["y"], [const("w", 12, 2, 3, 3), const("b", 12)], opset)
    def pieces(manifest):
        return sum(1 for cu in manifest["cus"] for n in cu["nodes"] if n.startswith("grouped_part"))

    assert pieces(decompose_and_compare(tmp_path / "a", path, feeds, max_cu_size=120)) == 2  # 2 groups a piece
    assert pieces(decompose_and_compare(tmp_path / "b", path, feeds, max_cu_size=40)) == 8   # 2 + 1 channels


def test_an_op_that_cannot_split_says_so(tmp_path):
    path, _ = save(tmp_path, [helper.make_node("Mul", ["x", "scale"], ["y"], name="scale")],
                   [("x", [1, 64])], ["y"], [const("scale", 1, 64)])
    with pytest.raises(CortexError, match=r"node 'scale' \(Mul\) holds 64 parameters, more than --max-cu-size 20, "
                                          r"and Cortex cannot split Mul"):
        decompose_model(path, tmp_path / "cus", PartitionIntoCUs(min_cu_size=0, max_cu_size=20, max_cu_depth=3))
