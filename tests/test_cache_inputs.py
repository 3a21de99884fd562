"""`decompose --cache-inputs NAME,...` (and `--cache-inputs-from` calibration feeds): work that depends
only on inputs that repeat between calls stays out of CUs that read the inputs that change, and its
CUs are marked `"cache": "repeating"`.

The model: k = Relu(m @ Wk) and a mask term b = Where(mask, 0, -1) (both on repeating inputs),
q = x @ Wq (x changes), y = (q * k + b) @ Wo. Under a --min-cu-size above the whole model the
partitioner would merge everything into one CU; with the repeating inputs named it must not. The
mask term is fused with the Add that reads the changing side: that fusion group is cut.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import assert_one_line_error, run_cli
from cortex.dag import validate_dag
from cortex.tools.onnx_reference import run_dag
from testdata import run_onnxruntime

WIDTH = 32
REPEATING_NODES = {"k_proj", "k_relu", "mask_bias"}
CHANGING_NODES = {"q_proj", "mix", "add_bias", "out_proj"}


def cache_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name):
        return numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 6).astype(np.float32), name)
    nodes = [helper.make_node("MatMul", ["m", "wk"], ["k0"], name="k_proj"),
             helper.make_node("Relu", ["k0"], ["k"], name="k_relu"),
             helper.make_node("Where", ["mask", "zero", "minus_one"], ["b"], name="mask_bias"),
             helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
             helper.make_node("Mul", ["q", "k"], ["qk"], name="mix"),
             helper.make_node("Add", ["qk", "b"], ["z"], name="add_bias"),
             helper.make_node("MatMul", ["z", "wo"], ["y"], name="out_proj")]
    row = [1, WIDTH]
    graph = helper.make_graph(
        nodes, "cache_model",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, row),
         helper.make_tensor_value_info("m", TensorProto.FLOAT, row),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, row)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, row)],
        [weight("wk"), weight("wq"), weight("wo"), numpy_helper.from_array(np.array(0, np.float32), "zero"),
         numpy_helper.from_array(np.array(-1, np.float32), "minus_one")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, WIDTH)).astype(np.float32),
            "m": rng.standard_normal((1, WIDTH)).astype(np.float32),
            "mask": rng.random((1, WIDTH)) > 0.5}


@pytest.fixture
def model_path(tmp_path):
    onnx.save(cache_model(), tmp_path / "m.onnx")
    return tmp_path / "m.onnx"


def decompose(model_path, out, *extra) -> dict:
    code, stdout, err = run_cli(["decompose", "--model-path", model_path, "--output-dir", out / "cus",
                                 "--min-cu-size", "100000", "--max-cu-depth", "8", "--json", *extra])
    assert code == 0, err
    code, _, err = run_cli(["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"])
    assert code == 0, err
    return json.loads(stdout)


def cu_of_node(manifest: dict) -> dict[str, dict]:
    return {node: cu for cu in manifest["cus"] for node in cu["nodes"]}


def test_repeating_work_stays_apart_and_is_marked(tmp_path, model_path):
    decompose(model_path, tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "cus" / "manifest.json").read_text())
    # Without the flag, everything is small and merges into one CU.
    assert len(plain["cus"]) == 1 and "cache" not in plain["cus"][0]

    summary = decompose(model_path, tmp_path / "cached", "--cache-inputs", "m,mask")
    manifest = json.loads((tmp_path / "cached" / "cus" / "manifest.json").read_text())
    jsonschema.validate(manifest, json.loads(open("cortex/schemas/manifest.schema.json").read()))
    dag = json.loads((tmp_path / "cached" / "dag.json").read_text())
    validate_dag(dag)
    assert manifest["options"]["cache_inputs"] == ["m", "mask"] == dag["options"]["cache_inputs"]
    where = cu_of_node(manifest)
    assert all(where[n].get("cache") == "repeating" for n in REPEATING_NODES)
    assert not any(where[n].get("cache") for n in CHANGING_NODES)
    repeating = [cu for cu in dag["cus"] if cu.get("cache") == "repeating"]
    assert summary["repeating_cus"] == [cu["id"] for cu in repeating]
    produced_by_repeating = {t for cu in repeating for t in cu["outputs"]}
    for cu in repeating:       # their inputs depend only on m and mask
        assert set(cu["inputs"]) <= {"m", "mask"} | produced_by_repeating
    for name, seed in (("same", 1), ("other", 2)):
        f = feeds(seed)
        np.testing.assert_allclose(run_dag(tmp_path / "cached" / "dag.json", f)["y"],
                                   run_onnxruntime(model_path, f)["y"], rtol=1e-5, atol=1e-6)


def test_cache_inputs_from_calibration_feeds(tmp_path, model_path):
    folder = tmp_path / "feeds"
    folder.mkdir()
    fixed = feeds(1)
    for i in range(3):     # x changes from feed to feed, m and mask do not
        np.savez(folder / f"feed{i}.npz", **{**fixed, "x": feeds(10 + i)["x"]})
    summary = decompose(model_path, tmp_path / "from_dir", "--cache-inputs-from", folder)
    assert summary["cache_inputs"] == ["m", "mask"]
    stacked = {name: np.stack([np.load(folder / f"feed{i}.npz")[name] for i in range(3)]) for name in fixed}
    np.savez(tmp_path / "stacked.npz", **stacked)
    summary = decompose(model_path, tmp_path / "from_file", "--cache-inputs-from", tmp_path / "stacked.npz")
    assert summary["cache_inputs"] == ["m", "mask"]
    manifest = json.loads((tmp_path / "from_file" / "cus" / "manifest.json").read_text())
    assert all(cu_of_node(manifest)[n].get("cache") == "repeating" for n in REPEATING_NODES)


def test_an_unknown_cache_input_is_one_clear_error(tmp_path, model_path):
    code, _, err = run_cli(["decompose", "--model-path", model_path, "--output-dir", tmp_path / "cus",
                            "--cache-inputs", "m,memory"])
    assert_one_line_error(code, err, "--cache-inputs 'memory'", "not an input of the model", "'x', 'm', 'mask'")
    assert not (tmp_path / "cus").exists()


def test_calibration_needs_two_feeds(tmp_path, model_path):
    np.savez(tmp_path / "one.npz", **{k: v[None] for k, v in feeds(1).items()})
    code, _, err = run_cli(["decompose", "--model-path", model_path, "--output-dir", tmp_path / "cus",
                            "--cache-inputs-from", tmp_path / "one.npz"])
    assert_one_line_error(code, err, "--cache-inputs-from", "at least 2")


def test_a_single_array_file_of_feeds_is_one_clear_error(tmp_path, model_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    code, _, err = run_cli(["decompose", "--model-path", model_path, "--output-dir", tmp_path / "cus",
                            "--cache-inputs-from", tmp_path / "x.npy"])
    assert_one_line_error(code, err, "--cache-inputs-from", "x.npy", ".npz")
    assert not (tmp_path / "cus").exists()
