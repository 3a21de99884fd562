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
    return sum(f.stat().st_size for f in (folder / "wasm").rglob("*") if f.is_file())


def test_the_int4_build_holds_a_fraction_of_the_float32_builds_bytes(tmp_path):
    """The tiny model's float32 token embedding (16 KB of its 100 KB) stays float32 in both builds,
    as the builder leaves it; the projections are 4-bit."""
    for precision in ("int4", "fp32"):
        _build(genai_model("llama", precision), tmp_path / precision)
    ratio = _weight_bytes(tmp_path / "int4") / _weight_bytes(tmp_path / "fp32")
    assert ratio < 0.5, ratio
