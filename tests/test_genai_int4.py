"""Language models as onnxruntime-genai's builder writes them for the CPU (samples/genai_models.py),
through the installed `cortex` at a fixed prompt length: the int4 build's MatMulNBits run at the
accuracy level the builder wrote (4: A quantized per block to int8), so `cortex verify` agrees with
onnxruntime; and the 4-bit CUs hold a fraction of the float32 build's bytes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from cli_helpers import run_cli
from samples.genai_models import genai_model, prompt_feeds

TOKENS = 8
DIMS = ("--dim", "batch_size=1", "--dim", f"sequence_length={TOKENS}", "--dim", f"total_sequence_length={TOKENS}",
        "--dim", "past_sequence_length=0", "--dim", "kv_cache_dim=16")

pytestmark = pytest.mark.slow     # the builder and torch: about 15 s a model the first time


def _build(model_folder, folder) -> None:
    for argv in (["decompose", "--model-path", model_folder / "model.onnx", "--output-dir", folder / "cus", *DIMS],
                 ["build-dag", "--cu-dir", folder / "cus", "--output", folder / "dag.json"],
                 ["compile-wasm", "--cu-dir", folder / "cus", "--output", folder / "wasm", "--dag", folder / "dag.json"]):
        code, _, err = run_cli(argv)
        assert code == 0, err


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_builders_int4_model_verifies_against_onnxruntime(name, tmp_path):
    model_folder = genai_model(name, "int4")
    levels = {next(a.i for a in node.attribute if a.name == "accuracy_level")
              for node in onnx.load(str(model_folder / "model.onnx"), load_external_data=False).graph.node
              if node.op_type == "MatMulNBits"}
    assert levels == {4}
    _build(model_folder, tmp_path)
    np.savez(tmp_path / "feeds.npz", **prompt_feeds(model_folder, TOKENS))
    code, out, err = run_cli(["verify", tmp_path / "dag.json", "--model", model_folder / "model.onnx",
                              "--input", tmp_path / "feeds.npz", "--json"])
    assert code == 0, out + err
    report = json.loads(out)
    logits = next(o for o in report["outputs"] if o["name"] == "logits")
    assert logits["max_abs_error"] < 1e-5, logits


def _weight_bytes(folder) -> int:
    """The weight bytes of every CU's module, as compile-wasm records them in dag.json."""
    dag = json.loads((folder / "dag.json").read_text())
    return sum(cu["artifacts"]["wasm"]["memory"]["weights_bytes"] for cu in dag["cus"])


def test_the_int4_builds_projections_hold_a_fifth_of_their_float32_bytes(tmp_path):
    """The builder leaves the token embedding and the rotary caches float32 in both builds; the
    projections it writes as MatMulNBits take at most 0.2x their float32 bytes in the int4 CUs."""
    for precision in ("int4", "fp32"):
        _build(genai_model("llama", precision), tmp_path / precision)
    model = onnx.load(str(genai_model("llama", "int4") / "model.onnx"), load_external_data=False)
    projections = sum(4 * next(a.i for a in n.attribute if a.name == "K") * next(a.i for a in n.attribute if a.name == "N")
                      for n in model.graph.node if n.op_type == "MatMulNBits")
    others = _weight_bytes(tmp_path / "fp32") - projections
    narrow = _weight_bytes(tmp_path / "int4") - others
    assert 0 < narrow <= 0.2 * projections, (narrow, projections)
