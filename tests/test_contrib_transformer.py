"""onnxruntime's transformer-optimizer ops (com.microsoft Attention, SkipLayerNormalization,
EmbedLayerNormalization, the GELUs...) compile by expansion (ir/ops/contrib_transformer.py,
contrib_attention.py) and give onnxruntime's results: one-node models through the functions the
commands run (decompose, build-dag, compile-wasm / compile-cuda; some thirty cases, and a CLI process
costs seconds each), then the transformer optimizer's MiniLM end to end through the CLI, and the
refusals as the CLI prints them.

The models are built here with onnx.helper, or with onnxruntime's optimizer
(samples/contrib_models.py, cached under .cache/).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import cortex
from backends.registry import target
from bench.conformance.devices import unavailable_reason
from cli_helpers import assert_one_line_error, first_failure, run_cli
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from ir.fs import write_bytes_atomically
from ir.options import from_text
from passes.partition import PartitionIntoCUs
from samples import contrib_models as contrib
from testdata import assert_values_close, minilm_feed, run_onnxruntime

RNG = np.random.default_rng(7)
RTOL, ATOL = 1e-4, 1e-5


def normal(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def int32(values) -> np.ndarray:
    return np.asarray(values, np.int32)


@dataclass
class Case:
    """One node: its inputs in order (a name in `feeds` or `weights`, or "" for an absent optional
    one) and outputs (named y0, y1... where used, "" where not)."""
    op: str
    feeds: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    order: list[str]
    outputs: list[bool] = field(default_factory=lambda: [True])
    attrs: dict = field(default_factory=dict)
    domain: str = "com.microsoft"

    def model(self, feeds: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
        feeds = self.feeds if feeds is None else feeds
        names = [f"y{j}" if used else "" for j, used in enumerate(self.outputs)]
        node = helper.make_node(self.op, self.order, names, name=self.op.lower(), domain=self.domain, **self.attrs)
        inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                  for k, v in feeds.items()]
        graph = helper.make_graph([node], self.op, inputs, [onnx.ValueInfoProto(name=n) for n in names if n],
                                  [numpy_helper.from_array(v, k) for k, v in self.weights.items()])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                       helper.make_opsetid("com.microsoft", 1)])


B, S, D, HEADS = 2, 5, 8, 2
X = normal(B, S, D)
QKV_WEIGHT, QKV_BIAS = {"w": normal(D, 3 * D)}, {"b": normal(3 * D)}
PACKED = {**QKV_WEIGHT, **QKV_BIAS}
IDS = RNG.integers(0, 12, (B, S)).astype(np.int32)
EMBEDDINGS = {"word": normal(12, D), "position": normal(7, D), "gamma": normal(D), "beta": normal(D)}
LN = {"gamma": normal(D), "beta": normal(D), "bias": normal(D)}

CASES = {
    "Gelu": Case("Gelu", {"x": X}, {}, ["x"]),
    "BiasGelu": Case("BiasGelu", {"x": X}, {"b": normal(D)}, ["x", "b"]),
    "FastGelu": Case("FastGelu", {"x": X}, {}, ["x"]),
    "FastGelu-bias": Case("FastGelu", {"x": X}, {"b": normal(D)}, ["x", "b"]),
    "QuickGelu": Case("QuickGelu", {"x": X}, {}, ["x"]),
    "QuickGelu-alpha": Case("QuickGelu", {"x": X}, {}, ["x"], attrs={"alpha": 1.25}),
    "FusedMatMul-alpha": Case("FusedMatMul", {"a": normal(2, 3, 4)}, {"b": normal(4, 6)}, ["a", "b"],
                              attrs={"alpha": 0.5}),
    "FusedMatMul-transA-transB": Case("FusedMatMul", {"a": normal(2, 4, 3), "b": normal(2, 6, 4)}, {}, ["a", "b"],
                                      attrs={"transA": 1, "transB": 1, "alpha": 2.0}),
    "FusedMatMul-transBatchA": Case("FusedMatMul", {"a": normal(3, 2, 4), "b": normal(2, 4, 5)}, {}, ["a", "b"],
                                    attrs={"transBatchA": 1}),
    "FusedMatMul-transBatchB-transB": Case("FusedMatMul", {"a": normal(2, 3, 4), "b": normal(5, 2, 4)}, {},
                                           ["a", "b"], attrs={"transBatchB": 1, "transB": 1}),
    # what a model onnxruntime saved optimised (ORT_ENABLE_EXTENDED) holds
    "FusedConv-relu": Case("FusedConv", {"x": normal(1, 3, 7, 7)}, {"w": normal(4, 3, 3, 3), "b": normal(4)},
                           ["x", "w", "b"], attrs={"activation": "Relu", "pads": [1, 1, 1, 1]}),
    "FusedConv-sum-leaky-relu": Case("FusedConv", {"x": normal(1, 3, 7, 7), "z": normal(1, 4, 7, 7)},
                                     {"w": normal(4, 3, 3, 3), "b": normal(4)}, ["x", "w", "b", "z"],
                                     attrs={"activation": "LeakyRelu", "activation_params": [0.2],
                                            "pads": [1, 1, 1, 1]}),
    "FusedConv-clip-strided-no-bias": Case("FusedConv", {"x": normal(1, 2, 9, 9)}, {"w": normal(6, 1, 3, 3)},
                                           ["x", "w"], attrs={"activation": "Clip", "activation_params": [-0.5, 0.6],
                                                              "strides": [2, 2], "group": 2}),
    "FusedGemm-sigmoid": Case("FusedGemm", {"a": normal(3, 5)}, {"b": normal(6, 5), "c": normal(6)}, ["a", "b", "c"],
                              attrs={"transB": 1, "alpha": 0.5, "activation": "Sigmoid"}),
    "FusedGemm-hard-sigmoid": Case("FusedGemm", {"a": normal(3, 5)}, {"b": normal(5, 6)}, ["a", "b"],
                                   attrs={"activation": "HardSigmoid", "activation_alpha": 0.3,
                                          "activation_beta": 0.4}),
    "SkipLayerNormalization": Case("SkipLayerNormalization", {"x": X, "skip": normal(B, S, D)}, LN,
                                   ["x", "skip", "gamma", "beta", "bias"]),
    "SkipLayerNormalization-all-outputs": Case("SkipLayerNormalization", {"x": X, "skip": normal(B, S, D)}, LN,
                                               ["x", "skip", "gamma", "beta", "bias"], [True] * 4,
                                               attrs={"epsilon": 1e-5}),
    "SkipLayerNormalization-gamma-only-broadcast-skip": Case(
        "SkipLayerNormalization", {"x": X, "skip": normal(S, D)}, {"gamma": LN["gamma"]}, ["x", "skip", "gamma"]),
    "SkipLayerNormalization-sum-without-beta": Case(
        "SkipLayerNormalization", {"x": X, "skip": normal(B, S, D)}, LN, ["x", "skip", "gamma", "", "bias"],
        [True, False, False, True]),
    "SkipSimplifiedLayerNormalization": Case("SkipSimplifiedLayerNormalization", {"x": X, "skip": normal(B, S, D)},
                                             LN, ["x", "skip", "gamma", "bias"], [True, True, True, True],
                                             attrs={"epsilon": 1e-6}),
    "SkipSimplifiedLayerNormalization-no-bias": Case("SkipSimplifiedLayerNormalization",
                                                     {"x": X, "skip": normal(B, S, D)}, LN, ["x", "skip", "gamma"]),
    "SimplifiedLayerNormalization": Case("SimplifiedLayerNormalization", {"x": X}, {"scale": normal(D)},
                                         ["x", "scale"], [True, True], attrs={"epsilon": 1e-5}, domain=""),
    "SimplifiedLayerNormalization-axis-1": Case("SimplifiedLayerNormalization", {"x": X}, {"scale": normal(S, D)},
                                                ["x", "scale"], attrs={"axis": 1}, domain=""),
    "EmbedLayerNormalization": Case(
        "EmbedLayerNormalization", {"ids": IDS, "segments": IDS % 2, "mask": int32([[1, 1, 1, 0, 0], [1, 1, 2, 1, 1]])},
        {**EMBEDDINGS, "segment": normal(2, D)},
        ["ids", "segments", "word", "position", "segment", "gamma", "beta", "mask"], [True, True, True]),
    "EmbedLayerNormalization-no-segments-no-mask": Case(
        "EmbedLayerNormalization", {"ids": IDS}, EMBEDDINGS, ["ids", "", "word", "position", "", "gamma", "beta"],
        [True, True], attrs={"epsilon": 1e-5}),
    "EmbedLayerNormalization-position-ids": Case(
        "EmbedLayerNormalization", {"ids": IDS, "positions": int32([[4, 3, 2, 1, 0]])}, EMBEDDINGS,
        ["ids", "", "word", "position", "", "gamma", "beta", "", "positions"], [True, True]),
    "Attention": Case("Attention", {"x": X}, PACKED, ["x", "w", "b"], attrs={"num_heads": HEADS}),
    "Attention-lengths": Case("Attention", {"x": X, "mask": int32([3, 5])}, PACKED, ["x", "w", "b", "mask"],
                              attrs={"num_heads": HEADS}),
    "Attention-lengths-and-starts": Case("Attention", {"x": X, "mask": int32([4, 5, 1, 2])}, PACKED,
                                         ["x", "w", "b", "mask"], attrs={"num_heads": HEADS}),
    "Attention-raw-mask": Case("Attention", {"x": X, "mask": int32([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0]])}, PACKED,
                               ["x", "w", "b", "mask"], attrs={"num_heads": HEADS, "mask_filter_value": -1e9}),
    "Attention-3d-mask": Case("Attention", {"x": X, "mask": RNG.integers(0, 2, (B, S, S)).astype(np.int32)}, PACKED,
                              ["x", "w", "b", "mask"], attrs={"num_heads": HEADS}),
    "Attention-unidirectional-lengths-scale": Case("Attention", {"x": X, "mask": int32([4, 2])}, PACKED,
                                                   ["x", "w", "b", "mask"],
                                                   attrs={"num_heads": HEADS, "unidirectional": 1, "scale": 0.3}),
    "Attention-qkv-hidden-sizes-no-bias": Case("Attention", {"x": X}, {"w": normal(D, 8 + 8 + 4)}, ["x", "w"],
                                               attrs={"num_heads": HEADS, "qkv_hidden_sizes": [8, 8, 4]}),
    "Attention-attention-bias": Case("Attention", {"x": X, "bias": normal(1, HEADS, S, S)}, PACKED,
                                     ["x", "w", "b", "", "", "bias"], attrs={"num_heads": HEADS}),
    "Attention-past-present": Case("Attention", {"x": X, "mask": np.ones((B, 3 + S), np.int32),
                                                 "past": normal(2, B, HEADS, 3, D // HEADS)}, PACKED,
                                   ["x", "w", "b", "mask", "past"], [True, True],
                                   attrs={"num_heads": HEADS, "unidirectional": 1}),
}


def rotary_caches(positions: int, half: int) -> dict[str, np.ndarray]:
    """The cos and sin caches [positions, half] of rotary embeddings with base 10000."""
    angles = np.arange(positions)[:, None] / 10000.0 ** (np.arange(half) / half)
    return {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}


L, H = 6, D // HEADS          # the keys' length in a cross attention; the head size
KV = {"k": normal(B, L, D), "v": normal(B, L, D)}
POSITIONS = RNG.integers(0, 10, (B, S)).astype(np.int64)
CASES |= {
    "MultiHeadAttention": Case("MultiHeadAttention", {"q": X, **KV}, {}, ["q", "k", "v"], attrs={"num_heads": HEADS}),
    "MultiHeadAttention-bias-scale": Case("MultiHeadAttention", {"q": X, **KV}, {"b": normal(3 * D)},
                                          ["q", "k", "v", "b"], attrs={"num_heads": HEADS, "scale": 0.3}),
    "MultiHeadAttention-lengths": Case("MultiHeadAttention", {"q": X, **KV, "mask": int32([3, 6])}, {"b": normal(3 * D)},
                                       ["q", "k", "v", "b", "mask"], attrs={"num_heads": HEADS}),
    "MultiHeadAttention-raw-mask": Case("MultiHeadAttention",
                                        {"q": X, **KV, "mask": int32([[1, 1, 0, 1, 0, 1], [1, 0, 0, 0, 0, 0]])}, {},
                                        ["q", "k", "v", "", "mask"], attrs={"num_heads": HEADS}),
    "MultiHeadAttention-attention-bias-value-width": Case(
        "MultiHeadAttention", {"q": X, "k": KV["k"], "v": normal(B, L, 6), "bias": normal(1, HEADS, S, L)},
        {"b": normal(2 * D + 6)}, ["q", "k", "v", "b", "", "bias"], attrs={"num_heads": HEADS}),
    "MultiHeadAttention-past-present-unidirectional": Case(
        "MultiHeadAttention", {"q": X, "k": normal(B, S, D), "v": normal(B, S, D),
                               "past_k": normal(B, HEADS, 3, H), "past_v": normal(B, HEADS, 3, H)},
        {"b": normal(3 * D)}, ["q", "k", "v", "b", "", "", "past_k", "past_v"], [True, True, True],
        attrs={"num_heads": HEADS, "unidirectional": 1}),
    "MultiHeadAttention-keys-in-heads": Case(
        "MultiHeadAttention", {"q": X, "k": normal(B, HEADS, L, H), "v": normal(B, HEADS, L, H),
                               "mask": int32([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])},
        {}, ["q", "k", "v", "", "mask"], [True, True, True], attrs={"num_heads": HEADS}),
    "RotaryEmbedding": Case("RotaryEmbedding", {"x": X, "positions": POSITIONS}, rotary_caches(10, H // 2),
                            ["x", "positions", "cos", "sin"]),
    "RotaryEmbedding-interleaved-num-heads": Case("RotaryEmbedding", {"x": X, "positions": POSITIONS},
                                                  rotary_caches(10, H // 2), ["x", "positions", "cos", "sin"],
                                                  attrs={"interleaved": 1, "num_heads": HEADS}),
    "RotaryEmbedding-one-offset": Case("RotaryEmbedding", {"x": X, "positions": np.array([3], np.int64)},
                                       rotary_caches(10, H // 2), ["x", "positions", "cos", "sin"]),
    "RotaryEmbedding-heads-first": Case("RotaryEmbedding", {"x": normal(B, HEADS, S, H), "positions": POSITIONS},
                                        rotary_caches(10, H // 2), ["x", "positions", "cos", "sin"]),
    "RotaryEmbedding-partial-interleaved-heads-first": Case(
        "RotaryEmbedding", {"x": normal(B, HEADS, S, 8), "positions": np.array([2], np.int64)},
        rotary_caches(10, 2), ["x", "positions", "cos", "sin"],
        attrs={"num_heads": HEADS, "rotary_embedding_dim": 4, "interleaved": 1}),
    "RotaryEmbedding-partial": Case("RotaryEmbedding", {"x": normal(B, S, 2 * 8), "positions": POSITIONS},
                                    rotary_caches(10, 2), ["x", "positions", "cos", "sin"],
                                    attrs={"num_heads": HEADS, "rotary_embedding_dim": 4}),
}


def gqa(feeds: dict, order: list[str], weights: dict | None = None, **attrs) -> Case:
    """GroupQueryAttention with 4 query heads over 2 key/value heads of size 16 (onnxruntime's CPU
    kernel needs a multiple of 16 with rotary embeddings), and every output. total_sequence_length
    (the present cache's length) is a constant, as in an exported model, which computes it from the
    attention mask's shape."""
    total = feeds.pop("total")
    return Case("GroupQueryAttention", feeds, {**(weights or {}), "total": total}, order, [True, True, True],
                attrs={"num_heads": 4, "kv_num_heads": 2, **attrs})


GQA_ORDER = ["q", "k", "v", "past_k", "past_v", "lengths", "total"]
CASES |= {
    "GroupQueryAttention-prompt": gqa(
        {"q": normal(B, S, 64), "k": normal(B, S, 32), "v": normal(B, S, 32), "past_k": normal(B, 2, 0, 16),
         "past_v": normal(B, 2, 0, 16), "lengths": int32([S - 1, S - 1]), "total": int32(S)}, GQA_ORDER),
    "GroupQueryAttention-decode-rotary-ragged": gqa(
        {"q": normal(B, 1, 64), "k": normal(B, 1, 32), "v": normal(B, 1, 32), "past_k": normal(B, 2, 4, 16),
         "past_v": normal(B, 2, 4, 16), "lengths": int32([4, 2]), "total": int32(5)},
        [*GQA_ORDER, "cos", "sin"], rotary_caches(16, 8), do_rotary=1),
    # a later chunk of a prompt (onnxruntime's kernel takes one sequence then)
    "GroupQueryAttention-chunk-interleaved-window-softcap": gqa(
        {"q": normal(1, 2, 64), "k": normal(1, 2, 32), "v": normal(1, 2, 32), "past_k": normal(1, 2, 4, 16),
         "past_v": normal(1, 2, 4, 16), "lengths": int32([5]), "total": int32(6)},
        [*GQA_ORDER, "cos", "sin"], rotary_caches(16, 8), do_rotary=1, rotary_interleaved=1,
        local_window_size=2, softcap=5.0, scale=0.4),
    "GroupQueryAttention-packed-prompt-rotary": gqa(
        {"q": normal(B, S, 128), "past_k": normal(B, 2, 0, 16), "past_v": normal(B, 2, 0, 16),
         "lengths": int32([S - 1, S - 1]), "total": int32(S)},
        ["q", "", "", "past_k", "past_v", "lengths", "total", "cos", "sin"], rotary_caches(16, 8), do_rotary=1),
}
# The masks must matter: were one ignored, onnxruntime's result would differ from the unmasked one.
MASKED = [name for name, case in CASES.items()
          if case.op in ("Attention", "MultiHeadAttention") and "mask" in case.feeds
          and not np.all(case.feeds["mask"] == 1)]


def test_fused_matmul_of_a_value_of_unknown_rank_expands_once_shapes_are_inferred(tmp_path):
    """A model onnxruntime saved optimised has no value_info: the rank FusedMatMul's transposes need
    is known only after shape inference, so its expansion waits for it."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["heads"]),
             helper.make_node("FusedMatMul", ["heads", "heads"], ["y0"], domain="com.microsoft", transB=1, alpha=0.5)]
    graph = helper.make_graph(nodes, "deferred", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [B, S, D])],
                              [onnx.ValueInfoProto(name="y0")],
                              [numpy_helper.from_array(np.array([B, S, HEADS, D // HEADS], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    path = save(model, tmp_path)
    got = cortex.load(build(path, tmp_path), device="wasm").run({"x": X})
    assert_values_close(got, run_onnxruntime(model, {"x": X}), RTOL, ATOL)


def save(model: onnx.ModelProto, tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def build(path: Path, tmp: Path, target_name: str = "wasm") -> Path:
    decompose_model(path, tmp / "cus", PartitionIntoCUs())
    dag_path = tmp / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(tmp / "cus", dag_path), indent=2).encode())
    chosen = target(target_name)
    options = from_text(chosen.options, compiler="nvrtc") if target_name == "cuda" else from_text(chosen.options)
    compile_cu_dir(chosen, tmp / "cus", tmp / f"{target_name}-bin", options, dag_path, jobs=1)
    return dag_path


def cli_build(path: Path, tmp: Path, extra=()) -> Path:
    for argv in (["decompose", "--model-path", path, "--output-dir", tmp / "cus", *extra],
                 ["build-dag", "--cu-dir", tmp / "cus", "--output", tmp / "dag.json"],
                 ["compile-wasm", "--cu-dir", tmp / "cus", "--output", tmp / "wasm-bin", "--dag", tmp / "dag.json"]):
        code, _, err = run_cli(argv)
        assert code == 0, f"{argv[0]}: {err}"
    return tmp / "dag.json"


def check(case: Case, tmp: Path, device: str = "wasm") -> None:
    dag = build(save(case.model(), tmp), tmp, "cuda" if device.startswith("cuda") else device)
    got = cortex.load(dag, device=device).run(case.feeds)
    want = run_onnxruntime(case.model(), case.feeds)
    assert_values_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", CASES, ids=str)
def test_contrib_op_matches_onnxruntime_on_wasm(name, tmp_path):
    check(CASES[name], tmp_path)


@pytest.mark.parametrize("name", MASKED, ids=str)
def test_the_attention_masks_change_the_result(name):
    case = CASES[name]
    order = ["" if n == "mask" else n for n in case.order]
    feeds = {k: v for k, v in case.feeds.items() if k != "mask"}
    unmasked = Case(case.op, feeds, case.weights, order, case.outputs, case.attrs).model(feeds)
    assert not np.allclose(run_onnxruntime(case.model(), case.feeds)["y0"], run_onnxruntime(unmasked, feeds)["y0"],
                           rtol=RTOL, atol=1e-3)


def test_bias_add_and_bias_split_gelu_follow_onnxruntimes_definition(tmp_path):
    """Neither has a CPU kernel in onnxruntime: the reference is its CUDA kernels' definition."""
    x, bias, skip = normal(B, S, 2 * D), normal(2 * D), normal(B, S, 2 * D)
    weights = {"bias": bias}
    add = Case("BiasAdd", {"x": x, "skip": skip}, weights, ["x", "bias", "skip"])
    got = cortex.load(build(save(add.model(), tmp_path / "add"), tmp_path / "add"), device="wasm").run(add.feeds)
    got = got["y0"]
    np.testing.assert_allclose(got, x + bias + skip, rtol=RTOL, atol=ATOL)
    split = Case("BiasSplitGelu", {"x": x}, weights, ["x", "bias"])
    got = cortex.load(build(save(split.model(), tmp_path / "split"), tmp_path / "split"), device="wasm")
    got = got.run(split.feeds)["y0"]
    biased = (x + bias).astype(np.float64)
    left, right = biased[..., :D], biased[..., D:]
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(got, left * 0.5 * right * (1 + erf(right / math.sqrt(2))), rtol=RTOL, atol=ATOL)


CUDA_SIM = ["SkipLayerNormalization-all-outputs", "EmbedLayerNormalization", "Attention-raw-mask",
            "Attention-lengths-and-starts", "MultiHeadAttention-past-present-unidirectional",
            "RotaryEmbedding-partial-interleaved-heads-first"]


@pytest.mark.skipif(unavailable_reason("cuda-sim") is not None, reason="the cuda-sim device is not available here")
@pytest.mark.parametrize("name", CUDA_SIM, ids=str)
def test_contrib_op_matches_onnxruntime_on_cuda_sim(name, tmp_path):
    check(CASES[name], tmp_path, device="cuda-sim")


def test_attention_with_a_shared_past_buffer_is_one_line_naming_the_node(tmp_path):
    case = Case("Attention", {"x": X, "past": normal(2, B, HEADS, 3, D // HEADS), "length": int32(3)}, PACKED,
                ["x", "w", "b", "", "past", "", "length"], [True, True], attrs={"num_heads": HEADS})
    code, _, err = run_cli(["decompose", "--model-path", save(case.model(), tmp_path), "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "'attention'", "past_sequence_length")


def test_a_group_query_attention_form_not_expanded_names_why_and_runs_as_a_fallback(tmp_path):
    """smooth_softmax is one of the forms the expansion leaves to onnxruntime: compile-wasm names the
    node and the reason, and with --fallback onnxruntime the node runs there."""
    base = CASES["GroupQueryAttention-prompt"]
    case = Case(base.op, base.feeds, base.weights, base.order, base.outputs,
                attrs={**base.attrs, "smooth_softmax": 1})
    path = save(case.model(), tmp_path / "model")
    command, code, err = first_failure(path, tmp_path / "plain")
    assert command == "compile-wasm"
    assert_one_line_error(code, err, "GroupQueryAttention (groupqueryattention", "smooth_softmax", "--fallback")
    dag = cli_build(path, tmp_path / "fallback", extra=["--fallback", "onnxruntime"])
    assert_values_close(cortex.load(dag).run(case.feeds), run_onnxruntime(case.model(), case.feeds), rtol=RTOL, atol=ATOL)


def test_an_expansion_that_cannot_be_written_at_the_models_opset_is_one_line(tmp_path):
    """The causal mask's Range has no form before opset 11 (ir/ops/body_opset.py)."""
    model = CASES["Attention-unidirectional-lengths-scale"].model()
    model.opset_import[0].version = 10
    code, _, err = run_cli(["decompose", "--model-path", save(model, tmp_path), "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "attention", "Range", "opset 11", "opset 10")


# -- the transformer optimizer's MiniLM ----------------------------------------------------------
@pytest.mark.parametrize("make", [contrib.optimized_minilm,
                                  functools.partial(contrib.optimized_minilm, gelu_approximation=True),
                                  functools.partial(contrib.optimized_minilm, multi_head_attention=True)],
                         ids=["minilm-optimized", "minilm-optimized-fastgelu", "minilm-optimized-mha"])
def test_optimized_minilm_compiles_for_wasm_and_verifies(make, tmp_path):
    """With a real sentence's mask (all-zero example inputs would mask every key: onnxruntime's
    -10000 filter then leaves scores on a grid of 1e-3, and the comparison measures that rounding)."""
    model = make()
    binding = [arg for name, size in model.dims.items() for arg in ("--dim", f"{name}={size}")]
    dag = cli_build(model.path, tmp_path, extra=["--max-cu-size", 50_000_000, *binding])
    ops = {op for cu in json.loads(dag.read_text())["cus"] for op in cu["op_types"]}
    assert not ops & set(model.contrib_ops), ops
    np.savez(tmp_path / "feed.npz", **minilm_feed(model.dims["batch"], model.dims["seq"]))
    code, out, err = run_cli(["verify", dag, "--model", model.path, "--input", tmp_path / "feed.npz"])
    assert code == 0, out + err
