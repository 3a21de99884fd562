"""Token generation in the JavaScript runtime (`session.generate`, js/src/generate.js) on the tiny
llama onnxruntime-genai's builder writes (samples/genai_models.py), int4 and fp32, built per (new
tokens 1 or 8) x (cache bucket 16 or 32) specialization: under Node the greedy ids equal
onnxruntime's greedy loop on the original model and each token's logits are within 1e-4 of its;
growing the cache from 16 to 32 mid-generation gives the ids of one 64-position bucket (prefilled
by chunks of 8, then 4, then single tokens); a seeded sampled run repeats; bad prompts and a model
without a cache are refused in one line.

onnxruntime runs the reference loop twice: on its natural feeds (the whole prompt, then the
present fed back as the past) and on the padded feeds the runtime makes (a fixed cache buffer, the
mask 1 up to the tokens in it, the prompt in chunks): both give the same ids."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnxruntime as ort
import pytest
from cli_helpers import run_cli
from js_cases import CASES_DIR, NODE, compiled_case, run_node_tests, write_case
from testdata import sample_model

from samples.cache import ensure_folder
from samples.genai_models import genai_model

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

PROMPT_SEED = 0
LOGITS_ATOL = 1e-4
HEADS, HEAD_SIZE, LAYERS = 2, 16, 2                    # samples/genai_models.py's llama
PASTS = [f"past_key_values.{layer}.{kind}" for layer in range(LAYERS) for kind in ("key", "value")]


def generation_build(precision: str, buckets: tuple[int, ...], chunks: tuple[int, ...]):
    """The llama at `precision` built once into .cache/js-tests, one specialization per (tokens in
    1 + `chunks`) x (bucket in `buckets`); its dag.json."""
    model = genai_model("llama", precision) / "model.onnx"
    digest = hashlib.sha256(model.read_bytes()).hexdigest()[:12]
    shapes = [arg for past in PASTS for arg in ("--input-shape", f"{past}=" + ",".join(
        f"1x{HEADS}x{b}x{HEAD_SIZE}" for b in buckets))]

    def build(folder):
        code, _, err = run_cli(["build", model, "--output", folder, "--dim", "batch_size=1",
                                "--dim", "sequence_length=" + ",".join(map(str, (1, *chunks))),
                                "--input-shape", "attention_mask=" + ",".join(f"1x{b}" for b in buckets), *shapes])
        assert code == 0, err
    name = f"generate-llama-{precision}-{digest}-p{'-'.join(map(str, buckets))}-s{'-'.join(map(str, chunks))}"
    return ensure_folder(CASES_DIR / name, build) / "dag.json"


def prompt(tokens: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(PROMPT_SEED).integers(0, 256, tokens)]


def natural_greedy(model, ids: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """onnxruntime's greedy loop as onnxruntime-genai feeds the model: the whole prompt, then one
    token a step with the present fed back as the past. The ids and each one's logits."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    past = {name: np.zeros((1, HEADS, 0, HEAD_SIZE), np.float32) for name in PASTS}
    step, made, logits = list(ids), [], []
    for _ in range(new_tokens):
        length = next(iter(past.values())).shape[2] + len(step)
        results = dict(zip([o.name for o in session.get_outputs()], session.run(None, {
            "input_ids": np.array([step], np.int64), "attention_mask": np.ones((1, length), np.int64), **past})))
        past = {name: results[name.replace("past_key_values", "present")] for name in PASTS}
        logits.append(results["logits"][0, -1])
        made.append(int(np.argmax(logits[-1])))
        step = [made[-1]]
    return made, np.array(logits)


def padded_greedy(model, ids: list[int], new_tokens: int, bucket: int, chunk: int) -> list[int]:
    """onnxruntime's greedy loop on the runtime's feeds: a `bucket`-long cache buffer, the prompt in
    chunks of `chunk` then single tokens, the mask 1 up to the tokens in the cache, only the new
    rows of present kept."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    cache = {name: np.zeros((1, HEADS, bucket, HEAD_SIZE), np.float32) for name in PASTS}
    length = 0

    def step(tokens: list[int]) -> np.ndarray:
        nonlocal length
        end = length + len(tokens)
        mask = (np.arange(bucket) < end).astype(np.int64)[None]
        results = dict(zip([o.name for o in session.get_outputs()], session.run(None, {
            "input_ids": np.array([tokens], np.int64), "attention_mask": mask, **cache})))
        for name in PASTS:
            cache[name][:, :, length:end] = results[name.replace("past_key_values", "present")][:, :, length:end]
        length = end
        return results["logits"][0, -1]

    whole = len(ids) // chunk * chunk
    for start in [*range(0, whole, chunk), *range(whole, len(ids))]:
        logits = step(ids[start:start + chunk] if start < whole else [ids[start]])
    made = []
    for _ in range(new_tokens):
        made.append(int(np.argmax(logits)))
        logits = step([made[-1]])
    return made


def generation_case(root, name: str, dag, ids: list[int], new_tokens: int, **checks):
    """A case.json for js/test/generate.test.js: the prompt, onnxruntime's greedy ids and logits
    (checked here to be the same on its natural and padded feeds), and which other checks to run."""
    model = json.loads(dag.read_text())["source_model"]["path"]
    model = (dag.parent / model).resolve()
    want, logits = natural_greedy(model, ids, new_tokens)
    assert padded_greedy(model, ids, new_tokens, bucket=64, chunk=8) == want
    folder = root / name
    folder.mkdir()
    case = write_case(folder, name, dag, [{"inputs": {}, "outputs": {"logits": logits}}], 0.0, LOGITS_ATOL)
    document = json.loads(case.read_text())
    document["generate"] = {"prompt": ids, "ids": want, "atol": LOGITS_ATOL, **checks}
    case.write_text(json.dumps(document, indent=1))
    return case


def _passed(report: str) -> set[str]:
    return {line.split(" - ", 1)[1] for line in report.splitlines() if line.startswith("ok ")}


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_node_makes_onnxruntimes_greedy_ids_and_logits(tmp_path, precision):
    """A 12-token prompt (a chunk of 8, then 4 single tokens) and 16 new tokens: 27 positions, so
    the cache moves from the 16 bucket to the 32 one on the way."""
    dag = generation_build(precision, (16, 32), (8,))
    case = generation_case(tmp_path, f"llama-{precision}", dag, prompt(12), 16, grows=True, errors=True)
    report = run_node_tests([case], tmp_path, "generate.test.js")
    expected = {f"llama-{precision}: greedy ids and logits are onnxruntime's",
                f"llama-{precision}: a bad prompt or option is refused in one line"}
    assert not expected - _passed(report), report[-3000:]


def test_growing_the_cache_mid_generation_gives_the_ids_of_one_large_bucket(tmp_path):
    """Buckets 16 and 32, a prompt of 12 and 10 new tokens, against one bucket of 64 prefilled by
    chunks of 8 and 4 (every run also against onnxruntime)."""
    dag = generation_build("int4", (16, 32), (8,))
    large = generation_build("int4", (64,), (4, 8))
    ids = prompt(12)
    case = generation_case(tmp_path, "llama-growth", dag, ids, 10, grows=True, twin=str(large),
                           twin_steps=[[8, 64], [4, 64]])
    report = run_node_tests([case], tmp_path, "generate.test.js")
    assert "llama-growth: growing the cache mid-generation gives the ids of one large bucket" in _passed(report), \
        report[-3000:]


def test_seeded_sampling_repeats_and_a_model_without_a_cache_is_refused(tmp_path):
    dag = generation_build("int4", (16, 32), (8,))
    sampled = generation_case(tmp_path, "llama-sampled", dag, prompt(5), 12, sampling=True)
    listing = compiled_case(sample_model("mlp"))
    (tmp_path / "mlp").mkdir()
    plain = write_case(tmp_path / "mlp", "mlp-no-cache", listing.parent / json.loads(listing.read_text())["dag"], [], 0, 0)
    document = json.loads(plain.read_text())
    document["generate"] = {"not_language_model": True}
    plain.write_text(json.dumps(document))
    report = run_node_tests([sampled, plain], tmp_path, "generate.test.js")
    expected = {"llama-sampled: seeded sampling repeats, and top-k 1 is greedy",
                "mlp-no-cache: a model without a key/value cache is refused in one line"}
    assert not expected - _passed(report), report[-3000:]
