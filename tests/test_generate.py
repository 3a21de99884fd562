"""Generation (cortex/generation/) on language models as onnxruntime-genai's builder writes them:
the logits of a chunked prefill and of decode steps against onnxruntime's own loop on the original
model, greedy tokens against onnxruntime-genai's generator, the prefix cache, bucket growth and
seeded sampling, and `cortex generate` through the installed script."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from cli_helpers import CORTEX
from cuda_cases import cuda_compiler_available

from cortex.generation import Generator, Sampling
from cortex.runtime.options import RuntimeOptions
from samples.genai_models import genai_model
from samples.torch_llm import torch_llm

PROMPT = [int(i) for i in np.random.default_rng(1).integers(3, 256, 21)]   # 2 chunks of 8, one of 4, one token


def build(model_folder, output, buckets="16,32,64", chunks="8,4", targets="wasm"):
    done = subprocess.run([str(CORTEX), "build", str(model_folder / "model.onnx"), "--output", str(output),
                           "--targets", targets, "--kv-buckets", buckets, "--prefill-chunks", chunks, "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return output / "dag.json"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = genai_model("llama", "int4")
    return folder, build(folder, tmp_path_factory.mktemp("llama") / "build")


def onnxruntime_loop(model_folder, prompt, new_tokens):
    """onnxruntime on the original model, its past grown by concatenation (no padding): the logits
    each greedy token comes from, and the tokens."""
    session = ort.InferenceSession(str(model_folder / "model.onnx"))
    inputs = {i.name: i.shape for i in session.get_inputs()}
    past_names = [n for n in inputs if n.startswith("past_key_values.")]
    past = {n: np.zeros((1, 2, 0, 16), np.float32) for n in past_names}      # the tiny configs' 2 heads of 16
    ids, length, rows, tokens = np.array([prompt], np.int64), 0, [], []
    for _ in range(new_tokens):
        positions = {"position_ids": np.arange(length, length + ids.shape[1])[None]} if "position_ids" in inputs else {}
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {
            "input_ids": ids, "attention_mask": np.ones((1, length + ids.shape[1]), np.int64), **positions, **past})))
        length += ids.shape[1]
        rows.append(outputs["logits"][0, -1])
        tokens.append(int(np.argmax(rows[-1])))
        past = {n: outputs[n.replace("past_key_values", "present")] for n in past_names}
        ids = np.array([[tokens[-1]]], np.int64)
    return np.array(rows), tokens


def test_cortex_generate_is_the_python_entry(llama):
    import cortex
    folder, dag = llama
    assert list(cortex.generate(dag, PROMPT, 6)) == onnxruntime_loop(folder, PROMPT, 6)[1]


def generated(dag, prompt, new_tokens, device="wasm", **options):
    generator, rows = Generator(dag, device, **options), []
    try:
        tokens = list(generator.generate(prompt, new_tokens, observe=lambda logits: rows.append(logits.copy())))
        return np.array(rows), tokens, generator.trace
    finally:
        generator.close()


def test_prefill_and_16_decode_steps_match_onnxruntimes_logits(llama):
    folder, dag = llama
    rows, tokens, trace = generated(dag, PROMPT, 17)
    expected_rows, expected_tokens = onnxruntime_loop(folder, PROMPT, 17)
    assert trace["prefill_steps"] == [8, 8, 4, 1] and len(trace["decode_ms"]) == 16
    assert trace["bucket"] == 64 and trace["bucket_growths"] == 1        # 21 tokens in 32, then 37 in 64
    np.testing.assert_allclose(rows, expected_rows, atol=1e-4 * np.abs(expected_rows).max(), rtol=0)
    assert tokens == expected_tokens


@pytest.mark.parametrize("exporter", ["dynamo", pytest.param("torchscript", marks=pytest.mark.slow)])
def test_a_torch_export_in_transformers_js_q4_generates_onnxruntimes_tokens(exporter, tmp_path):
    folder = torch_llm("llama", "q4", exporter)
    dag = build(folder, tmp_path / "torch", buckets="32,64")
    rows, tokens, trace = generated(dag, PROMPT, 17)
    expected_rows, expected_tokens = onnxruntime_loop(folder, PROMPT, 17)
    assert trace["prefill_steps"] == [8, 8, 4, 1] and trace["bucket_growths"] == 1
    np.testing.assert_allclose(rows, expected_rows, atol=1e-4 * np.abs(expected_rows).max(), rtol=0)
    assert tokens == expected_tokens


def test_greedy_tokens_equal_onnxruntime_genais_for_32_new_tokens(llama):
    og = pytest.importorskip("onnxruntime_genai")
    folder, dag = llama
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(PROMPT) + 32, min_length=len(PROMPT) + 32)
    native = og.Generator(model, params)
    native.append_tokens(np.array(PROMPT, np.int32))
    expected = []
    while not native.is_done():
        native.generate_next_token()
        expected.append(int(native.get_next_tokens()[0]))
    _, tokens, _ = generated(dag, PROMPT, 32)
    assert len(expected) == 32 and tokens[:len(expected)] == expected


def test_a_prefix_cache_hit_gives_bitwise_the_logits_of_the_same_prefill_without_it(llama):
    _, dag = llama
    generator, first, second = Generator(dag), [], []
    try:
        list(generator.generate(PROMPT, 4, observe=first.append))
        assert generator.trace["prefix_hit_tokens"] == 0 and generator.trace["prefix_cache"]["entries"] == 2
        longer = PROMPT[:16] + [5, 6, 7]
        list(generator.generate(longer, 4, observe=second.append))
        hit = generator.trace
        assert hit["prefix_hit_tokens"] == 16 and hit["prefill_steps"] == [1, 1, 1]
    finally:
        generator.close()
    fresh_rows, _, fresh = generated(dag, longer, 4, prefix_cache_mb=0)
    assert fresh["prefix_hit_tokens"] == 0 and fresh["prefill_steps"] == [8, 8, 1, 1, 1]
    assert np.array_equal(np.array(second), fresh_rows)


def test_the_prefix_cache_is_bounded_in_bytes(llama):
    _, dag = llama
    chunk_bytes = 2 * 2 * 2 * 8 * 16 * 4          # layers x (key, value) x heads x 8 rows x head size x float32
    generator = Generator(dag, prefix_cache_mb=1.5 * chunk_bytes / 2**20)
    try:
        list(generator.generate(PROMPT, 1))
        stats = generator.trace["prefix_cache"]
    finally:
        generator.close()
    assert stats["entries"] == 1 and stats["evictions"] == 1 and stats["bytes"] == chunk_bytes


def test_growing_the_bucket_mid_generation_changes_no_token(llama, tmp_path):
    folder, grown_dag = llama
    one_bucket = build(folder, tmp_path / "one", buckets="32")
    grown_rows, grown_tokens, grown = generated(grown_dag, PROMPT[:12], 16)     # 16 tokens in 16, then 32
    rows, tokens, trace = generated(one_bucket, PROMPT[:12], 16)
    assert grown["bucket_growths"] == 1 and trace["bucket_growths"] == 0
    assert grown_tokens == tokens
    np.testing.assert_allclose(grown_rows, rows, atol=1e-5 * np.abs(rows).max(), rtol=0)


def test_seeded_sampling_is_reproducible(llama):
    _, dag = llama
    sampling = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        generator = Generator(dag)
        try:
            runs.append(list(generator.generate(PROMPT, 12, sampling)))
        finally:
            generator.close()
    generator = Generator(dag)
    try:
        other = list(generator.generate(PROMPT, 12, Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=8)))
    finally:
        generator.close()
    assert runs[0] == runs[1] and other != runs[0]


def test_generation_stops_at_a_stop_id_and_at_the_largest_bucket(llama):
    _, dag = llama
    _, free, _ = generated(dag, PROMPT, 5)
    generator = Generator(dag)
    try:
        stopped = list(generator.generate(PROMPT, 5, stop_ids=[free[2]]))
        assert stopped == free[:free.index(free[2]) + 1] and generator.trace["finish"] == "stop"
        long = list(generator.generate(PROMPT, 60))
        assert len(long) == 64 - len(PROMPT) + 1 and generator.trace["finish"] == "context"
    finally:
        generator.close()


def run_cli(*args):
    return subprocess.run([str(CORTEX), "generate", *map(str, args)], capture_output=True, text=True)


def test_cortex_generate_prints_the_tokens_and_the_trace(llama):
    folder, dag = llama
    done = run_cli(dag.parent, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 6, "--json",
                   "--stop-ids", "")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ids"] == onnxruntime_loop(folder, PROMPT, 6)[1]
    assert summary["text"] == " ".join(f"w{i}" for i in summary["ids"])      # the word-level tokenizer
    # the sample's words are w<id> (w0, w1, w2 are its special tokens, matched first: avoid their prefixes)
    words = json.loads(run_cli(dag.parent, "--prompt", "w5 w6 w7 w33 w44", "--max-new-tokens", 6, "--json",
                               "--stop-ids", "").stdout)
    ids = json.loads(run_cli(dag.parent, "--prompt-ids", "5,6,7,33,44", "--max-new-tokens", 6, "--json",
                             "--stop-ids", "").stdout)
    assert words["prompt_ids"] == [5, 6, 7, 33, 44] and words["ids"] == ids["ids"]


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,999"], "token id 999 is outside the vocabulary of 256 ids"),
    (["--prompt-ids", ",".join(["3"] * 70)], "the prompt has 70 tokens, more than the largest key/value bucket (64"),
    (["--prompt-ids", "1,x"], "bad --prompt-ids '1,x'"),
    ([], "give the prompt once"),
    (["--prompt-ids", "1", "--top-p", "0"], "0 < top-p <= 1"),
])
def test_bad_input_is_one_line_and_exit_code_2(llama, args, message):
    done = run_cli(llama[1], *args)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_a_model_without_a_key_value_cache_is_refused_in_one_line(tmp_path):
    model = Path(__file__).resolve().parents[1] / "samples" / "mlp.onnx"
    done = subprocess.run([str(CORTEX), "build", str(model), "--output", str(tmp_path / "b"), "--kv-buckets", "16"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "not a language model with a key/value cache" in done.stderr
    assert not (tmp_path / "b").exists()
    plain = subprocess.run([str(CORTEX), "build", str(model), "--output", str(tmp_path / "plain"),
                            "--dim", "batch=1"], capture_output=True)
    assert plain.returncode == 0
    done = run_cli(tmp_path / "plain", "--prompt-ids", "1,2")
    assert done.returncode == 2 and "built for one input shape, not for generation" in done.stderr


def test_under_a_memory_budget_below_the_weights_the_cus_stream_in_and_the_tokens_stay(llama):
    _, dag = llama
    rows, tokens, free = generated(dag, PROMPT, 8)
    options = RuntimeOptions(cache_bytes=0, memory_budget_mb=0.25)
    budget_rows, budget_tokens, tight = generated(dag, PROMPT, 8, options=options)
    assert budget_tokens == tokens and np.array_equal(budget_rows, rows)
    memory = tight["memory"]
    assert memory["loads"] > 0 and memory["evictions"] > 0 and memory["prefetch_hits"] > 0
    # the key/value cache at the largest bucket is taken out of the budget before the CUs get theirs
    assert memory["budget_bytes"] == int(0.25 * 2**20) - 2 * 2 * 2 * 64 * 16 * 4
    assert memory["peak_resident_bytes"] <= memory["budget_bytes"] < free["memory"].get("resident_bytes", 1 << 40)


@pytest.mark.slow
@pytest.mark.skipif(not cuda_compiler_available(), reason="no CUDA compiler (cuda-sim needs its headers)")
@pytest.mark.parametrize("exporter", ["genai", "torch"])
def test_cuda_sim_matches_onnxruntimes_logits_for_the_prefill_and_16_decode_steps(exporter, tmp_path):
    folder = genai_model("llama", "int4") if exporter == "genai" else torch_llm("llama", "q4")
    dag = build(folder, tmp_path / "cuda", buckets="32,64", chunks="8", targets="cuda")
    rows, tokens, _ = generated(dag, PROMPT, 17, device="cuda-sim")
    expected_rows, expected_tokens = onnxruntime_loop(folder, PROMPT, 17)
    np.testing.assert_allclose(rows, expected_rows, atol=1e-4 * np.abs(expected_rows).max(), rtol=0)
    assert tokens == expected_tokens
