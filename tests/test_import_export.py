"""Import -> export keeps what ONNX models carry: external data, subgraphs, other domains, metadata."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ir.onnx_export import export_model, save_model
from ir.onnx_import import import_model, load_model
from passes import optimize_pipeline, run_pipeline


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def tensor(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def test_external_data_is_loaded_from_beside_the_model(tmp_path):
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [tensor("x", TensorProto.FLOAT, [2, 64])],
                              [tensor("y", TensorProto.FLOAT, [2, 32])], [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "ext.onnx"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.bin",
                    size_threshold=0)
    assert (tmp_path / "ext.bin").exists()
    g = load_model(path)
    assert np.array_equal(g.nodes[0].inputs[1].const, w)
    exported = export_model(g)
    onnx.checker.check_model(exported, full_check=True)
    x = np.ones((2, 64), np.float32)
    np.testing.assert_array_equal(run_ort(exported, {"x": x})[0], x @ w)


def test_if_subgraphs_with_outer_scope_reads_round_trip():
    then_graph = helper.make_graph([helper.make_node("Add", ["x", "k"], ["t_out"])], "then", [],
                                   [tensor("t_out", TensorProto.FLOAT, [3])])
    else_graph = helper.make_graph([helper.make_node("Constant", [], ["c"], value_floats=[1.0, 1.0, 1.0]),
                                    helper.make_node("Sub", ["x", "c"], ["e_out"])], "else", [],
                                   [tensor("e_out", TensorProto.FLOAT, [3])])
    nodes = [helper.make_node("Constant", [], ["k"], value=helper.make_tensor("kv", TensorProto.FLOAT, [3], [5, 6, 7])),
             helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph)]
    graph = helper.make_graph(nodes, "g", [tensor("cond", TensorProto.BOOL, []), tensor("x", TensorProto.FLOAT, [3])],
                              [tensor("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = import_model(model)
    assert [n.op_type for n in g.nodes] == ["If"]           # Constant became a constant value
    exported = export_model(g)
    onnx.checker.check_model(exported, full_check=True)
    x = np.array([1, 2, 3], np.float32)
    for cond in (True, False):
        feeds = {"cond": np.array(cond), "x": x}
        np.testing.assert_array_equal(run_ort(exported, feeds)[0], run_ort(model, feeds)[0])


def test_loop_body_round_trips_through_the_pipeline():
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "step"], ["acc_out"]), helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [tensor("i", TensorProto.INT64, []), tensor("cond_in", TensorProto.BOOL, []), tensor("acc_in", TensorProto.FLOAT, [2])],
        [tensor("cond_out", TensorProto.BOOL, []), tensor("acc_out", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Loop", ["trip", "", "x"], ["y"], body=body)]
    graph = helper.make_graph(nodes, "g", [tensor("x", TensorProto.FLOAT, [2])], [tensor("y", TensorProto.FLOAT, [2])],
                              [helper.make_tensor("trip", TensorProto.INT64, [], [4]),
                               helper.make_tensor("step", TensorProto.FLOAT, [2], [0.5, 1.5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g, _ = run_pipeline(import_model(model), optimize_pipeline())
    exported = export_model(g)
    onnx.checker.check_model(exported, full_check=True)
    x = np.array([1, 2], np.float32)
    np.testing.assert_array_equal(run_ort(exported, {"x": x})[0], x + 4 * np.array([0.5, 1.5], np.float32))


def test_ml_and_microsoft_domains_are_carried_through():
    """Ops without an expansion (ai.onnx.ml FeatureVectorizer, com.microsoft Inverse) stay as they
    are; one with an expansion (FastGelu) becomes standard ops (ir/ops/contrib_transformer.py)."""
    nodes = [helper.make_node("FeatureVectorizer", ["x"], ["s"], domain="ai.onnx.ml", inputdimensions=[3]),
             helper.make_node("Inverse", ["s"], ["i"], domain="com.microsoft"),
             helper.make_node("FastGelu", ["i"], ["y"], domain="com.microsoft")]
    graph = helper.make_graph(nodes, "g", [tensor("x", TensorProto.FLOAT, [3, 3])], [tensor("y", TensorProto.FLOAT, [3, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3),
                                                    helper.make_opsetid("com.microsoft", 1)])
    g, _ = run_pipeline(import_model(model), optimize_pipeline())
    kept = [(n.domain, n.op_type) for n in g.nodes if n.domain]
    assert kept == [("ai.onnx.ml", "FeatureVectorizer"), ("com.microsoft", "Inverse")]
    assert "Tanh" in {n.op_type for n in g.nodes}
    exported = export_model(g)
    x = np.array([[2, 1, 0], [1, 3, 1], [0, 1, 4]], dtype=np.float32)
    np.testing.assert_allclose(run_ort(exported, {"x": x})[0], run_ort(model, {"x": x})[0], rtol=1e-6, atol=1e-7)


def test_metadata_and_opsets_survive(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "named", [tensor("x", TensorProto.FLOAT, [1])],
                              [tensor("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="maker")
    model.metadata_props.add(key="author", value="someone")
    path = tmp_path / "m.onnx"
    save_model(export_model(import_model(model)), path)
    again = onnx.load(path)
    assert again.opset_import[0].version == 13
    assert again.producer_name == "maker"
    assert {p.key: p.value for p in again.metadata_props} == {"author": "someone"}
    assert again.graph.name == "named"
    assert not list(tmp_path.glob("*.tmp"))
