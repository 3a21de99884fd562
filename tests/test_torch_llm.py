"""Language models torch exports with a key/value cache (samples/torch_llm.py: Llama and Qwen2,
both exporters, float32 and transformers.js's q4), built by the installed `cortex build
--kv-buckets` and stepped as generation steps them: a prefill chunk of 8 tokens into an empty past
buffer of 32 rows, then single-token decodes with the buffer padded (the mask's zeros), each
step's new K/V rows written into the buffers at the cache's length. Every step's logits and new
present rows must match onnxruntime's on the same feeds.

The TorchScript export carries transformers 4.4x's mask construction (Trilu, Expand, ScatterND,
Where over shapes read at run time), which Cortex folds or computes at the fixed dims; its float32
Llama exports in a few seconds and stays in the fast suite. The others take up to 20 s to export.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import cortex
from cli_helpers import run_cli
from samples.torch_llm import concat_step_feeds, kv_shape, torch_llm

CHUNK, BUCKET, DECODES = 8, 32, 4
RTOL = 1e-4


def _build(model_folder, out, buckets=(BUCKET,)):
    code, _, err = run_cli(["build", model_folder / "model.onnx", "--output", out,
                            "--kv-buckets", ",".join(map(str, buckets)), "--prefill-chunks", str(CHUNK)])
    assert code == 0, err
    return cortex.load(out / "dag.json", device="wasm")


class Stepper:
    """The runtime's cache for a concat model: per past input a [1, KVH, P, HD] buffer whose first
    `cached` rows hold the K/V of the tokens run so far; onnxruntime gives the rows it keeps."""

    def __init__(self, name, model_path, bucket):
        self.model = onnx.load(str(model_path), load_external_data=False)
        self.reference = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.reference.get_outputs()]
        kv_heads, head_size = kv_shape(name)
        self.buffers = {v.name: np.zeros((1, kv_heads, bucket, head_size), np.float32)
                        for v in self.model.graph.input if v.name.startswith("past_key_values.")}
        self.cached = 0

    def grow(self, bucket):
        """Move to a larger buffer, zero-padded, as a bucket growth does."""
        for name, old in self.buffers.items():
            self.buffers[name] = np.zeros((*old.shape[:2], bucket, old.shape[3]), np.float32)
            self.buffers[name][:, :, :old.shape[2]] = old

    def step(self, compiled, token_ids) -> np.ndarray:
        """Run `token_ids` on both, compare, keep onnxruntime's new rows; the last token's logits."""
        feeds = concat_step_feeds(self.model, token_ids, self.cached, self.buffers)
        expected = dict(zip(self.output_names, self.reference.run(None, feeds)))
        got = compiled.run(feeds)
        bucket, tokens = next(iter(self.buffers.values())).shape[2], token_ids.shape[1]
        _assert_close(got["logits"], expected["logits"], f"logits after {self.cached} tokens")
        for past_name, buffer in self.buffers.items():
            present_name = past_name.replace("past_key_values", "present")
            new_rows = expected[present_name][:, :, bucket:bucket + tokens]
            # a --kv-buckets build outputs only the step's new rows (passes/new_cache_rows.py)
            _assert_close(got[present_name], new_rows, f"{present_name} after {self.cached} tokens")
            buffer[:, :, self.cached:self.cached + tokens] = new_rows
        self.cached += tokens
        return expected["logits"][:, -1]


def _assert_close(got, expected, what):
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    error = float(np.abs(got - expected).max() / np.abs(expected).max())
    assert error <= RTOL, f"{what}: relative error {error:.2e}"


def _prefill_then_decode(name, precision, exporter, tmp_path):
    folder = torch_llm(name, precision, exporter)
    compiled = _build(folder, tmp_path / "out")
    stepper = Stepper(name, folder / "model.onnx", BUCKET)
    prompt = np.random.default_rng(0).integers(0, 256, (1, CHUNK))
    last = stepper.step(compiled, prompt)
    for _ in range(DECODES):
        last = stepper.step(compiled, last.argmax(-1)[:, None])
    assert stepper.cached == CHUNK + DECODES


def test_torchscript_llama_prefills_and_decodes_as_onnxruntime(tmp_path):
    _prefill_then_decode("llama", "fp32", "torchscript", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name, precision, exporter", [
    ("llama", "fp32", "dynamo"), ("llama", "q4", "dynamo"), ("qwen2", "fp32", "dynamo"), ("qwen2", "q4", "dynamo"),
    ("llama", "q4", "torchscript"), ("qwen2", "fp32", "torchscript"), ("qwen2", "q4", "torchscript")])
def test_torch_exports_prefill_and_decode_as_onnxruntime(name, precision, exporter, tmp_path):
    _prefill_then_decode(name, precision, exporter, tmp_path)


def test_q4_is_transformers_js_format():
    """Every projection a symmetric 4-bit MatMulNBits in blocks of 32 without an accuracy level
    (no zero points), the token embedding left float32."""
    model = onnx.load(str(torch_llm("llama", "q4", "torchscript") / "model.onnx"))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 7 + 1        # per layer q, k, v, o, gate, up, down; the LM head
    for node in nbits:
        attributes = {a.name: a.i for a in node.attribute}
        assert (attributes["bits"], attributes["block_size"], attributes.get("accuracy_level", 0)) == (4, 32, 0)
        assert len(node.input) == 3, node.name          # A, B, scales: symmetric
    assert not any(n.op_type == "MatMul" and any(i in {t.name for t in model.graph.initializer} for i in n.input)
                   for n in model.graph.node)


@pytest.mark.slow
def test_a_step_after_bucket_growth_matches_onnxruntime(tmp_path):
    """Prefill and a decode at 32 rows, then the cache moves to 64 rows (copied, zero-padded) and
    takes another chunk and a decode there: both buckets are specializations of one build."""
    folder = torch_llm("llama", "fp32", "dynamo")
    compiled = _build(folder, tmp_path / "out", buckets=(BUCKET, 2 * BUCKET))
    stepper = Stepper("llama", folder / "model.onnx", BUCKET)
    rng = np.random.default_rng(1)
    stepper.step(compiled, rng.integers(0, 256, (1, CHUNK)))
    stepper.step(compiled, rng.integers(0, 256, (1, 1)))
    stepper.grow(2 * BUCKET)
    stepper.step(compiled, rng.integers(0, 256, (1, CHUNK)))
    stepper.step(compiled, rng.integers(0, 256, (1, 1)))
    assert stepper.cached == 2 * CHUNK + 2
