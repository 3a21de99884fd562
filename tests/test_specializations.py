"""Input-shape specializations: one bundle, one CU set per shape, weights and modules stored once,
the runtime picking the exact shape (or padding up to a bucket when asked)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_helpers import assert_one_line_error, run_cli
from onnx import TensorProto, helper, numpy_helper
from testdata import minilm_feed

import cortex
from cortex.dag import dag_schema
from cortex.specializations import SCHEMA_FILE, section_dag
from ir.errors import CortexError

RTOL, ATOL = 1e-4, 1e-5


def conv_model(path: Path) -> Path:
    """A Conv over a line image of any width (an OCR-style input), then Relu."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "line", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, "width"])], [w, b])
    return _save(graph, path)


def masked_attention_model(path: Path, vocab: int = 50) -> Path:
    """MiniLM's shape in small: token embeddings, one self-attention whose padded keys the mask
    hides (scores + (1 - mask) * -10000), a per-token projection; `seq` is dynamic."""
    rng = np.random.default_rng(1)
    consts = {"emb": rng.standard_normal((vocab, 16)), "wq": rng.standard_normal((16, 16)) / 4,
              "wo": rng.standard_normal((16, 16)) / 4, "one": np.array(1.0), "big": np.array(-10000.0)}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in consts.items()]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),
        helper.make_node("MatMul", ["e", "wq"], ["q"]),
        helper.make_node("Transpose", ["e"], ["et"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "et"], ["scores"]),
        helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "maskf"], ["hidden"]),
        helper.make_node("Mul", ["hidden", "big"], ["bias2"]),
        helper.make_node("Unsqueeze", ["bias2", "axis1"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "e"], ["ctx"]),
        helper.make_node("MatMul", ["ctx", "wo"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "masked", [
        helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "seq"]),
        helper.make_tensor_value_info("mask", TensorProto.INT64, [1, "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", 16])], inits)
    return _save(graph, path)


def _save(graph, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def build(model: Path, out: Path, *shape_options: str, compile_options: tuple = ()) -> Path:
    """decompose -> build-dag -> compile-wasm through the installed script; returns dag.json."""
    for argv in (["decompose", "--model-path", model, "--output-dir", out / "cus", "--min-cu-size", "64",
                  *shape_options],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 ["compile-wasm", "--cu-dir", out / "cus", "--output", out / "wasm-bin", "--dag", out / "dag.json",
                  *compile_options]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    return out / "dag.json"


def reference(model: Path, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def assert_valid_specialized_dag(dag_path: Path) -> dict:
    dag = json.loads(dag_path.read_text())
    assert dag["schema"] == "cortex.dag/2"
    jsonschema.validate(dag, json.loads(SCHEMA_FILE.read_text()))
    for section in dag["specializations"]:
        jsonschema.validate(section_dag(section), dag_schema())
    return dag


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and ".cwasm" not in p.name
               and p.name != "cwasm.verified.json")


def test_input_shape_list_builds_one_specialization_per_shape_with_weights_stored_once(tmp_path):
    model = conv_model(tmp_path / "line.onnx")
    dag_path = build(model, tmp_path / "out", "--input-shape", "x=1x3x8x16,1x3x8x32")
    dag = assert_valid_specialized_dag(dag_path)
    assert [s["input_shapes"] for s in dag["specializations"]] == [{"x": [1, 3, 8, 16]}, {"x": [1, 3, 8, 32]}]
    weights = [[w["path"] for cu in s["cus"] for w in cu["artifacts"]["wasm"]["weights"]]
               for s in dag["specializations"]]
    assert weights[0] and weights[0] == weights[1]          # both shapes load the very same files
    assert len(list((tmp_path / "out" / "wasm-bin" / "weights").iterdir())) == len(set(weights[0]))
    compiled = cortex.load(dag_path)
    for width in (16, 32):
        x = np.random.default_rng(width).standard_normal((1, 3, 8, width)).astype(np.float32)
        got = compiled.run({"x": x})["y"]
        assert compiled.specialization == f"x=1x3x8x{width}"
        np.testing.assert_allclose(got, reference(model, {"x": x}), rtol=RTOL, atol=ATOL)


def test_a_shape_no_specialization_holds_is_refused_in_one_line(tmp_path):
    model = conv_model(tmp_path / "line.onnx")
    dag_path = build(model, tmp_path / "out", "--input-shape", "x=1x3x8x16", "--input-shape", "x=1x3x8x32")
    np.save(tmp_path / "x.npy", np.zeros((1, 3, 8, 24), np.float32))
    code, _, err = run_cli(["run", dag_path, "--input", f"x={tmp_path / 'x.npy'}"])
    assert_one_line_error(code, err, "no shape specialization matches", "x=1x3x8x24", "x=1x3x8x16", "x=1x3x8x32")


def test_pad_to_bucket_runs_a_masked_input_on_the_next_larger_shape(tmp_path):
    model = masked_attention_model(tmp_path / "masked.onnx")
    dag_path = build(model, tmp_path / "out", "--dim", "seq=8,16")
    ids = np.array([[3, 14, 15, 9, 26]], np.int64)
    feeds = {"ids": ids, "mask": np.ones_like(ids)}
    padded = cortex.load(dag_path, pad_to_bucket="seq", pad_value=0)
    got = padded.run(feeds)["y"]
    assert padded.specialization == "seq=8" and got.shape == (1, 5, 16)
    np.testing.assert_allclose(got, reference(model, feeds), rtol=RTOL, atol=ATOL)
    for name, value in feeds.items():
        np.save(tmp_path / f"{name}.npy", value)
    inputs = [f"--input=ids={tmp_path / 'ids.npy'}", f"--input=mask={tmp_path / 'mask.npy'}"]
    code, _, err = run_cli(["run", dag_path, *inputs, "--pad-to-bucket", "seq", "--pad-value", "0",
                            "--output", tmp_path / "y.npz"])
    assert code == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["y"], got, rtol=0, atol=0)
    code, _, err = run_cli(["run", dag_path, *inputs])
    assert_one_line_error(code, err, "no shape specialization matches", "seq=8", "seq=16")
    code, _, err = run_cli(["run", dag_path, *inputs, "--pad-to-bucket", "width"])
    assert_one_line_error(code, err, "--pad-to-bucket width", "not a dim or input")
    longer = {"ids": np.ones((1, 20), np.int64), "mask": np.ones((1, 20), np.int64)}
    with pytest.raises(CortexError) as refused:
        padded.run(longer)
    assert "ids=1x20" in str(refused.value) and "seq=16" in str(refused.value)


def test_a_single_shape_dag_json_still_builds_and_loads_as_before(tmp_path):
    model = conv_model(tmp_path / "line.onnx")
    dag_path = build(model, tmp_path / "out", "--input-shape", "x=1x3x8x16")
    dag = json.loads(dag_path.read_text())
    assert dag["schema"] == "cortex.dag/1"
    record = dag["cus"][0]["artifacts"]["wasm"]
    assert record["path"] == "wasm-bin/cu-0000.wasm" and "weights" not in record     # weights embedded
    x = np.ones((1, 3, 8, 16), np.float32)
    np.testing.assert_allclose(cortex.load(dag_path).run({"x": x})["y"], reference(model, {"x": x}),
                               rtol=RTOL, atol=ATOL)
    code, _, err = run_cli(["run", dag_path, "--example-inputs", "--pad-to-bucket", "width"])
    assert_one_line_error(code, err, "--pad-to-bucket width", "one input shape")


def test_external_weights_give_the_same_results_and_are_checked_at_load(tmp_path):
    model = conv_model(tmp_path / "line.onnx")
    dag_path = build(model, tmp_path / "out", "--input-shape", "x=1x3x8x16", compile_options=("--external-weights",))
    record = json.loads(dag_path.read_text())["cus"][0]["artifacts"]["wasm"]
    assert record["path"].startswith("wasm-bin/modules/") and record["weights"]
    x = np.random.default_rng(2).standard_normal((1, 3, 8, 16)).astype(np.float32)
    loaded = cortex.load(dag_path)
    np.testing.assert_allclose(loaded.run({"x": x})["y"], reference(model, {"x": x}), rtol=RTOL, atol=ATOL)
    # A store the sandbox rebuilds (after a trap) starts zeroed: its weights must be written again.
    loaded.device.instances.clear()
    np.testing.assert_allclose(loaded.run({"x": x}, policy="strict")["y"], reference(model, {"x": x}),
                               rtol=RTOL, atol=ATOL)
    assert loaded.sandbox_events()["rebuilt"] == len(loaded.dag["cus"])
    weight_file = dag_path.parent / record["weights"][0]["path"]
    data = bytearray(weight_file.read_bytes())
    data[0] ^= 1
    weight_file.write_bytes(bytes(data))
    code, _, err = run_cli(["run", dag_path, "--example-inputs"])
    assert_one_line_error(code, err, weight_file.name, "sha256 differs")


@pytest.mark.parametrize(("flag", "value", "fragment"), [
    ("--dim", "seq=32,x", "bad --dim"),
    ("--dim", "seq=32,32", "each dim and value once"),
    ("--input-shape", "x=1x3x8x16,1x3xfourx8", "bad --input-shape"),
])
def test_bad_specialization_options_are_one_line(tmp_path, flag, value, fragment):
    model = conv_model(tmp_path / "line.onnx")
    code, _, err = run_cli(["decompose", "--model-path", model, "--output-dir", tmp_path / "cus", flag, value])
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "cus").exists()


def test_verify_checks_the_specialization_its_inputs_pick(tmp_path):
    model = conv_model(tmp_path / "line.onnx")
    dag_path = build(model, tmp_path / "out", "--input-shape", "x=1x3x8x16,1x3x8x32")
    np.save(tmp_path / "x.npy", np.random.default_rng(3).standard_normal((1, 3, 8, 32)).astype(np.float32))
    code, out, err = run_cli(["verify", dag_path, "--model", model, "--input", f"x={tmp_path / 'x.npy'}", "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and report["outputs"][0]["shape"] == [1, 8, 8, 32]


@pytest.mark.slow
def test_minilm_for_three_sequence_lengths_costs_at_most_1_2x_one_build(tmp_path):
    from samples.minilm import ensure_minilm
    model = ensure_minilm()
    one = build(model, tmp_path / "one", "--dim", "batch=1", "--dim", "seq=128")
    spec = build(model, tmp_path / "spec", "--dim", "batch=1", "--dim", "seq=32,64,128")
    assert_valid_specialized_dag(spec)
    ratio = folder_bytes(spec.parent) / folder_bytes(one.parent)
    assert ratio <= 1.2, ratio
    compiled = cortex.load(spec)
    for seq in (32, 64, 128):
        feeds = minilm_feed(1, seq)
        got = compiled.run(feeds)["last_hidden_state"]
        assert compiled.specialization == f"seq={seq}"
        np.testing.assert_allclose(got, reference(model, feeds), rtol=RTOL, atol=1e-4)
    for name, value in minilm_feed(1, 96).items():
        np.save(tmp_path / f"{name}.npy", value)
    code, _, err = run_cli(["run", spec, f"--input=input_ids={tmp_path / 'input_ids.npy'}",
                            f"--input=attention_mask={tmp_path / 'attention_mask.npy'}"])
    assert_one_line_error(code, err, "no shape specialization matches", "input_ids=1x96", "seq=32", "seq=128")
