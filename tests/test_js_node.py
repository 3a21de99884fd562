"""The JavaScript runtime (js/) under Node's test runner, on models the Python side compiled, against
onnxruntime's outputs: the samples, a decomposed If (branch CUs), a two-output model (requested
outputs) by default; the light models and MiniLM in the slow run."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from js_cases import CASES_DIR, NODE, compiled_case, run_node_tests, write_case
from onnx import TensorProto, helper, numpy_helper
from test_conditional_cus import build, feeds_for, if_model
from test_data_dependent import compile_wasm, detection_feeds, detection_model
from test_fallback_cus import WIDTH, mixed_model
from testdata import light_model, minilm, run_onnxruntime, sample_model
from wasm_cases import compile_pipeline

from samples.cache import ensure_folder

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

# One sample per feature set the dag may record, relaxed SIMD included (Node 20 needs its flag).
SAMPLE_FEATURES = {"mlp": "simd", "cnn": "simd,bulk-memory,relaxed-simd", "transformer_block": "simd,bulk-memory"}


def branch_case():
    """A decomposed If on a bool input: each request names the other branch's CUs as inactive."""
    def make(tmp):
        model = if_model("input")
        dag = build(tmp, model, "--min-cu-size", "16")
        by_value = {value: sorted(cu["id"] for cu in dag["cus"] if cu.get("activation", {}).get("equals") == value)
                    for value in (True, False)}
        assert by_value[True] and by_value[False]
        requests = []
        for cond in (True, False):
            feeds = feeds_for("input", 1.0, cond)
            requests.append({"inputs": feeds, "outputs": run_onnxruntime(model, feeds), "inactive": by_value[not cond]})
        write_case(tmp, "if-on-input", tmp / "dag.json", requests, 1e-4, 1e-5)
    return ensure_folder(CASES_DIR / "if-on-input", make) / "case.json"


def two_outputs_case():
    """Two outputs from separate CUs: asking for one leaves the other's CUs `not needed`."""
    def make(tmp):
        rng = np.random.default_rng(0)
        weights = [numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), f"w{i}") for i in range(2)]
        row = [2, 32]
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w0"], ["a"]), helper.make_node("Relu", ["a"], ["first"]),
             helper.make_node("MatMul", ["x", "w1"], ["b"]), helper.make_node("Tanh", ["b"], ["second"])],
            "two_outputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, row)],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, row) for n in ("first", "second")], weights)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.save(model, tmp / "m.onnx")
        # At most one weight per CU: the two outputs come from CUs of their own.
        dag = compile_pipeline(tmp / "m.onnx", tmp, min_cu_size=16, max_cu_size=1500)
        cus = json.loads(dag.read_text())["cus"]
        producers = {cu["id"] for cu in cus if "second" in cu["outputs"]}
        assert not any("first" in cu["outputs"] for cu in cus if cu["id"] in producers)
        feeds = {"x": rng.standard_normal(row).astype(np.float32)}
        expected = run_onnxruntime(model, feeds)
        write_case(tmp, "two-outputs", dag, [
            {"inputs": feeds, "outputs": expected},
            {"inputs": feeds, "outputs": {"first": expected["first"]}, "fetches": ["first"],
             "not_needed": sorted(producers)}], 1e-4, 1e-5)
    return ensure_folder(CASES_DIR / "two-outputs", make) / "case.json"


def fallback_case():
    """A TfIdfVectorizer, which no target lowers, in a fallback CU on onnxruntime-web."""
    def make(tmp):
        model = mixed_model()
        build(tmp, model, "--fallback", "onnxruntime", "--min-cu-size", "16")
        feeds = {"x": np.random.default_rng(1).standard_normal((4, WIDTH)).astype(np.float32)}
        write_case(tmp, "fallback-cus", tmp / "dag.json", [{"inputs": feeds, "outputs": run_onnxruntime(model, feeds)}],
                   1e-4, 1e-5, fallback=True)
    return ensure_folder(CASES_DIR / "fallback-cus", make) / "case.json"


def bounded_case():
    """NonMaxSuppression and the gathers after it, one node per CU: data-dependent lengths cross CU
    borders at their real shape, and the outputs come back at it (three feeds, three lengths)."""
    def make(tmp):
        model = detection_model(tmp / "postprocess.onnx")
        dag = compile_wasm(model, tmp, "--max-cu-depth", 1, "--min-cu-size", 0)
        requests = [{"inputs": feeds, "outputs": run_onnxruntime(onnx.load(model), feeds)} for feeds in detection_feeds()]
        assert len({r["outputs"]["det_scores"].shape for r in requests}) == 3
        write_case(tmp, "bounded-lengths", dag, requests, 1e-6, 1e-7)
    return ensure_folder(CASES_DIR / "bounded-lengths", make) / "case.json"


def test_node_runs_the_samples_branches_requested_outputs_fallbacks_and_bounded_lengths(tmp_path):
    cases = [compiled_case(sample_model(name), features, opt_level="3" if "relaxed" in features else "2",
                           min_cu_size=256, max_cu_depth=3)
             for name, features in SAMPLE_FEATURES.items()]
    run_node_tests([*cases, branch_case(), two_outputs_case(), fallback_case(), bounded_case()], tmp_path)


@pytest.mark.slow
def test_node_runs_the_light_models_and_minilm(tmp_path):
    from testdata import LARGE_LIGHT_MODELS, LIGHT_MODEL_NAMES
    cases = [compiled_case(light_model(name), rtol=1e-3, atol=1e-4)
             for name in LIGHT_MODEL_NAMES if name not in LARGE_LIGHT_MODELS]
    cases.append(compiled_case(minilm(1, 128), rtol=1e-3, atol=1e-4))
    run_node_tests(cases, tmp_path, "models.test.js")
