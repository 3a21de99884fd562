"""`cortex inspect` says, for each op of a model, how each target computes it: its own kernel, the
op's ONNX function body, an expansion into other ops, or only in a fallback CU on onnxruntime."""

from __future__ import annotations

import json

import onnx
from onnx import TensorProto, helper

from backends.registry import targets
from tests.cli_helpers import run_cli


def cli_ok(argv) -> str:
    code, out, err = run_cli(argv)
    assert code == 0, err
    return out


def _model() -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Celu", ["r"], ["c"], name="celu"),
             helper.make_node("CenterCropPad", ["x", "crop"], ["cropped"], name="crop"),
             helper.make_node("Gelu", ["c"], ["y"], name="gelu", domain="com.microsoft"),
             helper.make_node("FeatureVectorizer", ["x"], ["features"], name="features", domain="ai.onnx.ml",
                              inputdimensions=[3])]
    graph = helper.make_graph(nodes, "routes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("cropped", TensorProto.FLOAT, [2, 2]),
                               helper.make_tensor_value_info("features", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor("crop", TensorProto.INT64, [2], [2, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1),
                                                   helper.make_opsetid("ai.onnx.ml", 3)])


def test_inspect_reports_how_each_target_computes_each_op(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_model(), path)
    report = json.loads(cli_ok(["inspect", path, "--json"]))["lowering"]
    names = set(targets())
    assert {"wasm", "cuda"} <= names
    expected = {"Relu": "kernel", "Celu": "kernel", "CenterCropPad": "function body", "com.microsoft::Gelu": "expansion",
                "ai.onnx.ml::FeatureVectorizer": "none"}
    for op, route in expected.items():
        assert report[op]["targets"] == {name: route for name in names}, (op, report[op])
        assert report[op]["fallback_only"] == (route == "none")
    # The expansion's ops are listed too, with their own routes.
    assert report["Erf"]["targets"]["wasm"] == "kernel"


def test_inspect_table_names_fallback_ops(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_model(), path)
    text = cli_ok(["inspect", path])
    rows = [line for line in text.splitlines() if "│" in line]
    row = next(line for line in rows if "ai.onnx.ml::" in line)
    assert row.count("fallback") == len(targets()), row
    assert "expansion" in next(line for line in rows if "com.microsoft::" in line)
