"""The decoder of a public encoder-decoder (torch.nn.TransformerDecoder, samples/encoder_decoder.py),
one decoding step per model call, decomposed with `--cache-inputs memory,memory_mask`: the
cross-attention key/value projections of every layer read only the encoder memory, so they must
land in CUs marked `"cache": "repeating"`, and greedy decoding through the compiled model must
follow onnxruntime's step by step."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cli_helpers import run_cli
from cortex.runtime import load
from samples import encoder_decoder as ed


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = ed.ensure_encoder_decoder()
    out = tmp_path_factory.mktemp("encoder_decoder")
    for argv in (["decompose", "--model-path", path, "--output-dir", out / "cus", "--cache-inputs",
                  ",".join(ed.CACHE_INPUTS)],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 ["compile-wasm", "--cu-dir", out / "cus", "--dag", out / "dag.json", "--output", out / "wasm"]):
        code, _, err = run_cli(argv)
        assert code == 0, (argv[0], err)
    return path, out


def memory_projections(model: onnx.ModelProto) -> list[str]:
    """Names of the MatMul/Gemm nodes of the source model that multiply a weight by a tensor computed
    from `memory` alone: the cross-attention key/value projections (read off the ONNX graph, not
    from the partitioner's own analysis)."""
    weights = {i.name for i in model.graph.initializer}
    on_memory = {"memory"}
    found = []
    for node in model.graph.node:
        if node.op_type == "Constant":
            weights.update(node.output)
            continue
        data = [i for i in node.input if i and i not in weights]
        if data and all(i in on_memory for i in data):
            on_memory.update(node.output)
            if node.op_type in ("MatMul", "Gemm") and any(i in weights for i in node.input):
                found.append(node.name)
    return found


def test_cross_attention_key_value_projections_are_repeating(built):
    path, out = built
    projections = memory_projections(onnx.load(path))
    assert len(projections) == ed.LAYERS     # one fused key/value projection per layer
    manifest = json.loads((out / "cus" / "manifest.json").read_text())
    assert manifest["options"]["cache_inputs"] == list(ed.CACHE_INPUTS)
    cu_of = {node: cu for cu in manifest["cus"] for node in cu["nodes"]}
    assert all(cu_of[name].get("cache") == "repeating" for name in projections), projections
    repeating = [cu for cu in manifest["cus"] if cu.get("cache") == "repeating"]
    produced = {t for cu in repeating for t in cu["outputs"]}
    for cu in repeating:
        assert set(cu["inputs"]) <= set(ed.CACHE_INPUTS) | produced, cu["id"]
    changing = [cu for cu in manifest["cus"] if "cache" not in cu]
    assert any("tokens" in cu["inputs"] for cu in changing)


def test_greedy_decoding_follows_onnxruntime(built):
    path, out = built
    strict, balanced = load(out / "dag.json", policy="strict"), load(out / "dag.json", policy="balanced")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected_tokens, expected_rows = ed.greedy_decode(lambda feeds: {"logits": session.run(None, feeds)[0]})
    strict_tokens, strict_rows = ed.greedy_decode(strict.run)
    traces = []

    def run_balanced(feeds):
        result = balanced.run(feeds)
        traces.append(balanced.last_trace)
        return result
    tokens, rows = ed.greedy_decode(run_balanced)
    assert len(rows) == ed.MAX_STEPS == 16
    for step, (got, expected) in enumerate(zip(strict_rows, expected_rows)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
    np.testing.assert_array_equal(strict_tokens, expected_tokens)
    assert len(set(tokens[0].tolist())) > 3        # the decode moves: each step's input differs
    # The cache changes nothing: balanced's logits are strict's, bit for bit.
    np.testing.assert_array_equal(tokens, strict_tokens)
    assert all(np.array_equal(a, b) for a, b in zip(rows, strict_rows))
    # From the second step on, exactly the repeating CUs (every layer's cross-attention key/value
    # projections) are cache hits; the first step runs every CU.
    manifest = json.loads((out / "cus" / "manifest.json").read_text())
    repeating = {cu["id"] for cu in manifest["cus"] if cu.get("cache") == "repeating"}
    assert repeating and traces[0]["skipped_cus"] == []
    for trace in traces[1:]:
        hits = {s["cu"] for s in trace["skipped_cus"] if s["reason"] == "cache hit"}
        assert hits == repeating, trace["skipped_cus"]
        assert set(trace["activated_cus"]) == {cu["id"] for cu in manifest["cus"]} - repeating
