"""Token generation in the JavaScript runtime (`session.generate`, js/src/generate.js) on the tiny
llama onnxruntime-genai's builder writes (samples/genai_models.py), int4 and fp32, built per (new
tokens 1 or 8) x (cache bucket 16 or 32) specialization: under Node the greedy ids equal
onnxruntime's greedy loop on the original model and each token's logits are within 1e-4 of its;
growing the cache from 16 to 32 mid-generation gives the ids of one 64-position bucket (prefilled
by chunks of 8, then 4, then single tokens); a seeded sampled run repeats; bad prompts and a model
without a cache are refused in one line. The prefix cache (js/test/prefix_cache.test.js): a prompt
sharing two chunks of 8 with an earlier one restores them and gives onnxruntime's ids with bitwise
the logits of a session without the cache; its bound evicts the least recently used chunk.

onnxruntime runs the reference loop twice: on its natural feeds (the whole prompt, then the
present fed back as the past) and on the padded feeds the runtime makes (a fixed cache buffer, the
mask 1 up to the tokens in it, the prompt in chunks): both give the same ids."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_helpers import run_cli
from js_cases import CASES_DIR, NODE, compiled_case, run_node_tests, write_case
from onnx import TensorProto, helper, numpy_helper
from testdata import sample_model

from samples.cache import ensure_folder
from samples.genai_models import genai_model

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

PROMPT_SEED = 0
LOGITS_ATOL = 1e-4
HEADS, HEAD_SIZE, LAYERS = 2, 16, 2                    # samples/genai_models.py's llama
VOCAB, WIDTH = 32, 16                                  # concat_attention_model
PASTS = [f"past_key_values.{layer}.{kind}" for layer in range(LAYERS) for kind in ("key", "value")]


def generation_build(precision: str, buckets: tuple[int, ...], chunks: tuple[int, ...]):
    """The llama at `precision` built once into .cache/js-tests by `cortex build --kv-buckets`, one
    specialization per (tokens in 1 + `chunks`) x (bucket in `buckets`), present only the new rows;
    its dag.json."""
    model = genai_model("llama", precision) / "model.onnx"
    digest = hashlib.sha256(model.read_bytes()).hexdigest()[:12]

    def build(folder):
        code, _, err = run_cli(["build", model, "--output", folder, "--kv-buckets", ",".join(map(str, buckets)),
                                "--prefill-chunks", ",".join(map(str, chunks))])
        assert code == 0, err
    name = f"generate-rows-llama-{precision}-{digest}-p{'-'.join(map(str, buckets))}-s{'-'.join(map(str, chunks))}"
    return ensure_folder(CASES_DIR / name, build) / "dag.json"


def concat_attention_model(path) -> None:
    """One attention layer as standard exports write it: present = Concat(past, new rows), so
    present is P + S long; position_ids pick a position embedding and, with the mask, which keys a
    query sees (causal within the new rows). Vocabulary 32, 2 heads of 8."""
    rng = np.random.default_rng(3)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name) for name, shape in [
        ("embed", (VOCAB, WIDTH)), ("position_embed", (64, WIDTH)), ("wq", (WIDTH, WIDTH)), ("wk", (WIDTH, WIDTH)),
        ("wv", (WIDTH, WIDTH)), ("wo", (WIDTH, WIDTH)), ("lm_head", (WIDTH, VOCAB))]]
    constants = [numpy_helper.from_array(np.asarray(value), name) for name, value in [
        ("heads_shape", np.array([1, -1, 2, 8], np.int64)), ("width_shape", np.array([1, -1, WIDTH], np.int64)),
        ("query_shape", np.array([1, 1, -1, 1], np.int64)), ("key_shape", np.array([1, 1, 1, -1], np.int64)),
        ("flat", np.array([-1], np.int64)), ("zero", np.array(0, np.int64)), ("one", np.array(1, np.int64)),
        ("two", np.array(2, np.int64)), ("scale", np.array(8 ** -0.5, np.float32)),
        ("open", np.array(0.0, np.float32)), ("closed", np.array(-1e9, np.float32))]]
    node = helper.make_node
    nodes = [node("Gather", ["embed", "input_ids"], ["token"]), node("Gather", ["position_embed", "position_ids"], ["place"]),
             node("Add", ["token", "place"], ["x"])]
    for name in ("q", "k", "v"):
        nodes += [node("MatMul", ["x", f"w{name}"], [f"{name}_rows"]), node("Reshape", [f"{name}_rows", "heads_shape"], [f"{name}_heads"]),
                  node("Transpose", [f"{name}_heads"], [f"{name}_new"], perm=[0, 2, 1, 3])]
    nodes += [
        node("Concat", ["past_key_values.0.key", "k_new"], ["present.0.key"], axis=2),
        node("Concat", ["past_key_values.0.value", "v_new"], ["present.0.value"], axis=2),
        node("Transpose", ["present.0.key"], ["keys_t"], perm=[0, 1, 3, 2]), node("MatMul", ["q_new", "keys_t"], ["raw"]),
        node("Mul", ["raw", "scale"], ["scores"]),
        # key positions: the past slots 0..P-1, then the new rows' position_ids
        node("Shape", ["past_key_values.0.key"], ["past_shape"]), node("Gather", ["past_shape", "two"], ["past_length"]),
        node("Range", ["zero", "past_length", "one"], ["past_positions"]), node("Reshape", ["position_ids", "flat"], ["new_positions"]),
        node("Concat", ["past_positions", "new_positions"], ["key_positions"], axis=0),
        node("Reshape", ["key_positions", "key_shape"], ["key_row"]), node("Reshape", ["position_ids", "query_shape"], ["query_column"]),
        node("Greater", ["key_row", "query_column"], ["future"]), node("Not", ["future"], ["seen"]),
        node("Cast", ["attention_mask"], ["kept"], to=TensorProto.BOOL), node("Reshape", ["kept", "key_shape"], ["kept_row"]),
        node("And", ["seen", "kept_row"], ["allowed"]), node("Where", ["allowed", "open", "closed"], ["bias"]),
        node("Add", ["scores", "bias"], ["biased"]), node("Softmax", ["biased"], ["attention"], axis=-1),
        node("MatMul", ["attention", "present.0.value"], ["mixed"]), node("Transpose", ["mixed"], ["mixed_t"], perm=[0, 2, 1, 3]),
        node("Reshape", ["mixed_t", "width_shape"], ["attended"]), node("MatMul", ["attended", "wo"], ["projected"]),
        node("Add", ["x", "projected"], ["residual"]), node("MatMul", ["residual", "lm_head"], ["logits"])]
    ints = lambda name, *shape: helper.make_tensor_value_info(name, TensorProto.INT64, shape)      # noqa: E731
    floats = lambda name, *shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)   # noqa: E731
    graph = helper.make_graph(nodes, "concat_attention", [
        ints("input_ids", 1, "s"), ints("attention_mask", 1, "t"), ints("position_ids", 1, "s"),
        floats("past_key_values.0.key", 1, 2, "p", 8), floats("past_key_values.0.value", 1, 2, "p", 8)],
        [floats("logits", 1, "s", VOCAB), floats("present.0.key", 1, 2, "t", 8), floats("present.0.value", 1, 2, "t", 8)],
        weights + constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def concat_build(buckets: tuple[int, ...]):
    """concat_attention_model built once for one-token steps on each bucket (the mask is P + 1 long)."""
    def build(folder):
        concat_attention_model(folder / "concat.onnx")
        pasts = [arg for kind in ("key", "value") for arg in ("--input-shape", f"past_key_values.0.{kind}=" + ",".join(
            f"1x2x{b}x8" for b in buckets))]
        code, _, err = run_cli(["build", folder / "concat.onnx", "--output", folder / "out", "--input-shape", "input_ids=1x1",
                                "--input-shape", "position_ids=1x1", "--input-shape",
                                "attention_mask=" + ",".join(f"1x{b + 1}" for b in buckets), *pasts])
        assert code == 0, err
    return ensure_folder(CASES_DIR / f"generate-concat-attention-p{'-'.join(map(str, buckets))}", build) / "out" / "dag.json"


def prompt(tokens: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(PROMPT_SEED).integers(0, 256, tokens)]


def past_shapes(dag) -> dict[str, tuple[int, int]]:
    """Each past input's (heads, head size), as the build bound them."""
    shapes = json.loads(dag.read_text())["specializations"][0]["input_shapes"]
    return {name: (shape[1], shape[3]) for name, shape in shapes.items() if name.startswith("past_key_values.")}


def natural_greedy(model, ids: list[int], new_tokens: int, pasts: dict[str, tuple[int, int]]):
    """onnxruntime's greedy loop as onnxruntime-genai feeds the model: the whole prompt, then one
    token a step with the present fed back as the past (position_ids counting on, when the model
    takes them). The ids and each one's logits."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    positions = any(i.name == "position_ids" for i in session.get_inputs())
    past = {name: np.zeros((1, heads, 0, width), np.float32) for name, (heads, width) in pasts.items()}
    step, made, logits = list(ids), [], []
    for _ in range(new_tokens):
        length = next(iter(past.values())).shape[2] + len(step)
        feeds = {"input_ids": np.array([step], np.int64), "attention_mask": np.ones((1, length), np.int64), **past}
        if positions:
            feeds["position_ids"] = np.arange(length - len(step), length, dtype=np.int64)[None]
        results = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        past = {name: results[name.replace("past_key_values", "present")] for name in pasts}
        logits.append(results["logits"][0, -1])
        made.append(int(np.argmax(logits[-1])))
        step = [made[-1]]
    return made, np.array(logits)


def padded_greedy(model, ids: list[int], new_tokens: int, bucket: int, chunk: int) -> list[int]:
    """onnxruntime's greedy loop on the runtime's feeds for a shared-buffer model (the llama): a
    `bucket`-long cache buffer, the prompt in chunks of `chunk` then single tokens, the mask 1 up to
    the tokens in the cache, only the new rows of present kept."""
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


def generation_case(root, name: str, dag, ids: list[int], new_tokens: int, shared_buffer: bool = True, **checks):
    """A case.json for js/test/generate.test.js: the prompt, onnxruntime's greedy ids and logits
    (for the llama checked here to be the same on its natural and padded feeds), and which other
    checks to run."""
    model = (dag.parent / json.loads(dag.read_text())["source_model"]["path"]).resolve()
    want, logits = natural_greedy(model, ids, new_tokens, past_shapes(dag))
    if shared_buffer:
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


def test_node_makes_onnxruntimes_ids_on_a_model_that_concatenates_its_cache(tmp_path):
    """Present = Concat(past, new): the mask pads between the L cached tokens and the new one,
    position_ids count on, the new rows are present's last; 5 + 15 positions outgrow bucket 16."""
    dag = concat_build((16, 32))
    case = generation_case(tmp_path, "concat-attention", dag, [3, 5, 7, 9, 11], 16, shared_buffer=False, grows=True)
    report = run_node_tests([case], tmp_path, "generate.test.js")
    assert "concat-attention: greedy ids and logits are onnxruntime's" in _passed(report), report[-3000:]


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


def test_a_proxied_generate_streams_the_in_thread_ids_and_logits(tmp_path):
    dag = generation_build("int4", (16, 32), (8,))
    case = generation_case(tmp_path, "llama-proxy", dag, prompt(5), 6)
    report = run_node_tests([case], tmp_path, "generate.test.js", "proxy.test.js")
    expected = "llama-proxy: a proxied generate streams the in-thread ids and logits, and a throwing onToken stops it"
    assert expected in _passed(report), report[-3000:]


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


def test_node_restores_a_shared_prefix_bitwise_and_evicts_the_least_recently_used_chunk(tmp_path):
    """A 20-token prompt leaves its two chunks of 8 in the cache; a 25-token prompt sharing its first
    16 restores them and runs one chunk of 8 and one token; both prompts use the 32 bucket."""
    dag = generation_build("int4", (16, 32), (8,))
    warm = prompt(20)
    shared = warm[:16] + [5, 6, 7, 8, 9, 10, 11, 12, 13]
    case = generation_case(tmp_path, "llama-prefix", dag, shared, 6, prefix={"warm": warm, "chunk": 8, "bucket": 32})
    report = run_node_tests([case], tmp_path, "prefix_cache.test.js")
    expected = {"llama-prefix: a shared prefix is restored and gives bitwise the logits of a run without the cache",
                "llama-prefix: the prefix cache's bound evicts the least recently used chunk"}
    assert not expected - _passed(report), report[-3000:]
