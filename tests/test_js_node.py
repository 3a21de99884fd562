"""The JavaScript runtime (js/) under Node's test runner, on models the Python side compiled, against
onnxruntime's outputs: the samples, a decomposed If (branch CUs), a two-output model (requested
outputs), shape specializations (exact shapes, a refused shape, padding to a bucket, the offline
policy on each shape) and external weights (a tampered file refused) by default; the light models
and MiniLM in the slow run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from cli_helpers import assert_one_line_error, run_cli
from js_cases import (
    CASES_DIR,
    NODE,
    compiled_case,
    ortweb_installed,
    run_node_tests,
    write_case,
    write_requests,
)
from onnx import TensorProto, helper, numpy_helper
from test_cache_inputs import cache_model
from test_cache_inputs import feeds as cache_feeds
from test_conditional_cus import build, feeds_for, if_model
from test_data_dependent import compile_wasm, detection_feeds, detection_model
from test_fallback_cus import WIDTH, mixed_model
from test_specializations import build as build_specialized
from test_specializations import conv_model, masked_attention_model
from testdata import LIGHT_MODEL_NAMES, light_model, minilm, run_onnxruntime, sample_model
from wasm_cases import compile_pipeline, make_model

import cortex
from bench.cu_overhead import ensure_chain
from cortex.runtime.specialized import SpecializedModel
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


def repeating_case():
    """tests/test_cache_inputs.py's model built with --cache-inputs m,mask: under balanced the CUs on
    m and mask alone (marked repeating) are keyed and hit when they repeat; the CUs on x are not."""
    def make(tmp):
        model = cache_model()
        dag = build(tmp, model, "--cache-inputs", "m,mask", "--min-cu-size", "100000", "--max-cu-depth", "8")
        assert any(cu.get("cache") == "repeating" for cu in dag["cus"])
        assert any(cu.get("cache") != "repeating" for cu in dag["cus"])
        requests = [{"inputs": f, "outputs": run_onnxruntime(model, f)} for f in (cache_feeds(0), cache_feeds(1))]
        write_case(tmp, "repeating-inputs", tmp / "dag.json", requests, 1e-4, 1e-5)
    return ensure_folder(CASES_DIR / "repeating-inputs", make) / "case.json"


def trap_case():
    """Transpose, Div and Transpose on int32, one CU each (elementwise ops would fuse into one),
    which a strict and a balanced plan run as one segment: a zero divisor traps in its middle CU,
    and the error names that CU."""
    def make(tmp):
        square = [4, 4]
        nodes = [helper.make_node("Transpose", ["a"], ["s"], perm=[1, 0]),
                 helper.make_node("Div", ["s", "b"], ["q"], name="divide"),
                 helper.make_node("Transpose", ["q"], ["y"], perm=[1, 0])]
        model = make_model(nodes, [helper.make_tensor_value_info("a", TensorProto.INT32, square),
                                   helper.make_tensor_value_info("b", TensorProto.INT32, square)],
                           [helper.make_tensor_value_info("y", TensorProto.INT32, square)])
        onnx.save(model, tmp / "div.onnx")
        dag = compile_pipeline(tmp / "div.onnx", tmp / "out", max_cu_depth=1, min_cu_size=0)
        cus = json.loads(dag.read_text())["cus"]
        divide = [cu["id"] for cu in cus if cu.get("op_types") == ["Div"]]
        assert len(cus) == 3 and len(divide) == 1
        a = np.arange(16, dtype=np.int32).reshape(4, 4)
        good = {"a": a, "b": np.full((4, 4), 2, np.int32)}
        write_case(tmp, "trap-in-segment", dag, [{"inputs": good, "outputs": run_onnxruntime(model, good)}], 0, 0)
        trap = _side_requests(tmp, "trap", [{"inputs": {"a": a, "b": np.zeros((4, 4), np.int32)}, "outputs": {}}])
        _with(tmp / "case.json", trap={"inputs": trap[0]["inputs"], "cu": divide[0], "ops": "Div"})
    return ensure_folder(CASES_DIR / "trap-in-segment", make) / "case.json"


def chain_case(length: int):
    """bench/cu_overhead.py's chain of `length` CUs (a 64x64 MatMul and a Relu each), built once."""
    model_path, dag = ensure_chain(length)

    def make(tmp):
        rng = np.random.default_rng(length)
        requests = []
        for _ in range(2):
            feeds = {"x": rng.standard_normal((1, 64)).astype(np.float32)}
            requests.append({"inputs": feeds, "outputs": run_onnxruntime(onnx.load(model_path), feeds)})
        write_case(tmp, f"chain-{length}", dag, requests, 1e-4, 1e-6)
        _with(tmp / "case.json", segment=length)
    return ensure_folder(CASES_DIR / f"chain-{length}", make) / "case.json"


def _with(case_json, **extra) -> None:
    """Adds what js/test/specialized.test.js reads to a case.json: `specialized` (the compiled shapes
    as the Python runtime lists them, a shape it refuses, padded requests with Python's outputs) and
    `external_weights`."""
    case = json.loads(case_json.read_text())
    case.update(extra)
    case_json.write_text(json.dumps(case, indent=1))


def _side_requests(case_folder, name: str, requests: list[dict]) -> list[dict]:
    """`requests` written into a subfolder (their files named as the case's own would be)."""
    (case_folder / name).mkdir()
    described = write_requests(case_folder / name, requests)
    for entry in described:
        for spec in [*entry["inputs"].values(), *entry["outputs"].values()]:
            spec["file"] = f"{name}/{spec['file']}"
    return described


def conv_widths_case():
    """The Conv model built for widths 16 and 32 (cortex.dag/2, the weights in files both share),
    and width 10 padded with 0.5 up to 16 by the Python runtime."""
    def make(tmp):
        model = conv_model(tmp / "line.onnx")
        dag = build_specialized(model, tmp / "out", "--input-shape", "x=1x3x8x16,1x3x8x32")
        rng = np.random.default_rng(5)
        requests = []
        for width in (16, 32, 16):
            feeds = {"x": rng.standard_normal((1, 3, 8, width)).astype(np.float32)}
            requests.append({"inputs": feeds, "outputs": run_onnxruntime(onnx.load(model), feeds)})
        write_case(tmp, "specialized-widths", dag, requests, 1e-4, 1e-5)
        python = cortex.load(dag)
        assert isinstance(python, SpecializedModel)
        refused = _side_requests(tmp, "refused", [{"inputs": {"x": np.zeros((1, 3, 8, 40), np.float32)}, "outputs": {}}])
        # Padding along an input given several shapes, with a pad value that is not zero: the
        # Conv sees it, so this checks the rule and the value, not the model's accuracy.
        padding = cortex.load(dag, pad_to_bucket="x", pad_value=0.5)
        feeds = {"x": rng.standard_normal((1, 3, 8, 10)).astype(np.float32)}
        padded = [{"inputs": feeds, "outputs": padding.run(feeds)}]
        assert padding.specialization == "x=1x3x8x16" and padded[0]["outputs"]["y"].shape == (1, 8, 8, 10)
        described = _side_requests(tmp, "padded", padded)
        described[0]["specialization"] = "x=1x3x8x16"
        _with(tmp / "case.json", specialized={"compiled_for": python.compiled_shapes(), "refused": refused[0]["inputs"],
                                              "refused_text": "x=1x3x8x40",
                                              "pad": {"bucket": "x", "value": 0.5, "requests": described}})
    return ensure_folder(CASES_DIR / "specialized-widths-padded", make) / "case.json"


def masked_seq_case():
    """The masked attention built for seq=8,16: exact lengths, and lengths 5 and 11 padded up to
    the next bucket, against the Python runtime's padded outputs (and onnxruntime's)."""
    def make(tmp):
        model = masked_attention_model(tmp / "masked.onnx")
        dag = build_specialized(model, tmp / "out", "--dim", "seq=8,16")
        rng = np.random.default_rng(6)

        def feeds_of(length):
            ids = rng.integers(0, 50, (1, length)).astype(np.int64)
            return {"ids": ids, "mask": np.ones_like(ids)}
        exact = [feeds_of(n) for n in (8, 16)]
        write_case(tmp, "specialized-seq", dag, [{"inputs": f, "outputs": run_onnxruntime(onnx.load(model), f)}
                                                 for f in exact], 1e-4, 1e-5)
        python = cortex.load(dag, pad_to_bucket="seq", pad_value=0)
        padded = []
        for n, bucket in ((5, "seq=8"), (11, "seq=16")):
            feeds = feeds_of(n)
            got = python.run(feeds)
            assert python.specialization == bucket and got["y"].shape == (1, n, 16)
            np.testing.assert_allclose(got["y"], run_onnxruntime(onnx.load(model), feeds)["y"], rtol=1e-4, atol=1e-5)
            padded.append({"inputs": feeds, "outputs": got, "specialization": bucket})
        described = _side_requests(tmp, "padded", padded)
        for entry, request in zip(described, padded):
            entry["specialization"] = request["specialization"]
        refused = _side_requests(tmp, "refused", [{"inputs": feeds_of(20), "outputs": {}}])
        _with(tmp / "case.json", specialized={"compiled_for": python.compiled_shapes(), "refused": refused[0]["inputs"],
                                              "refused_text": "ids=1x20 mask=1x20",
                                              "pad": {"bucket": "seq", "value": 0, "requests": described}})
    return ensure_folder(CASES_DIR / "specialized-seq", make) / "case.json"


def external_weights_case():
    """One shape, compiled with --external-weights: content-addressed modules and weight files."""
    def make(tmp):
        model = conv_model(tmp / "line.onnx")
        dag = build_specialized(model, tmp / "out", "--input-shape", "x=1x3x8x16",
                                compile_options=("--external-weights",))
        record = json.loads(dag.read_text())["cus"][0]["artifacts"]["wasm"]
        assert record["path"].startswith("wasm-bin/modules/") and record["weights"]
        feeds = {"x": np.random.default_rng(7).standard_normal((1, 3, 8, 16)).astype(np.float32)}
        write_case(tmp, "external-weights", dag, [{"inputs": feeds, "outputs": run_onnxruntime(onnx.load(model), feeds)}],
                   1e-4, 1e-5)
        _with(tmp / "case.json", external_weights=True)
    return ensure_folder(CASES_DIR / "external-weights", make) / "case.json"


def test_node_runs_the_samples_branches_requested_outputs_fallbacks_and_bounded_lengths(tmp_path):
    cases = [compiled_case(sample_model(name), features, opt_level="3" if "relaxed" in features else "2",
                           min_cu_size=256, max_cu_depth=3)
             for name, features in SAMPLE_FEATURES.items()]
    run_node_tests([*cases, branch_case(), two_outputs_case(), fallback_case(), bounded_case()], tmp_path)


def test_node_runs_request_plans_segments_traps_and_repeating_cus(tmp_path):
    cases = [chain_case(32), trap_case(), repeating_case(), branch_case(), two_outputs_case()]
    report = run_node_tests(cases, tmp_path, "models.test.js", "plan.test.js")
    passed = set(re.findall(r"^ok \d+ - (.+)$", report, re.MULTILINE))
    expected = {"chain-32: strict and balanced run the whole chain as one segment, with one trace entry per CU",
                "trap-in-segment: a trap inside a segment names its CU, and the session still serves",
                "repeating-inputs: the CUs marked repeating hit the cache when their inputs repeat; the others run"}
    assert not expected - passed, report[-3000:]


def test_node_runs_sessions_in_a_proxy_worker(tmp_path):
    """`proxy: true` (js/src/proxy.js): the session in a worker_threads Worker gives the in-thread
    session's bits, trace and progress, refuses in the same words, and serves again after release()
    ended its Worker."""
    report = run_node_tests([chain_case(32), branch_case(), two_outputs_case()], tmp_path, "proxy.test.js")
    passed = set(re.findall(r"^ok \d+ - (.+)$", report, re.MULTILINE))
    expected = {"proxied sessions give the in-thread session's bits and trace, and serve again after release",
                "a proxied session refuses what the in-thread one refuses, in one line, and keeps serving"}
    assert not expected - passed, report[-3000:]


@pytest.mark.slow
def test_node_runs_a_chain_of_1024_cus(tmp_path):
    report = run_node_tests([chain_case(1024)], tmp_path, "models.test.js", "plan.test.js")
    assert "ok" in report and "chain-1024: strict and balanced run the whole chain as one segment" in report


def test_node_runs_shape_specializations_and_external_weights(tmp_path):
    cases = [conv_widths_case(), masked_seq_case(), external_weights_case()]
    report = run_node_tests(cases, tmp_path, "models.test.js", "specialized.test.js")
    expected = [f"{name}: {what}" for name in ("specialized-widths", "specialized-seq")
                for what in ("each compiled shape runs on its specialization",
                             "a shape no specialization holds is refused in one line naming the compiled ones",
                             "a tampered weight file is refused at create, naming it and its CU")]
    expected += [f"{name}{what}" for name in ("specialized-widths", "specialized-seq")
                 for what in (": padding to a bucket gives the Python runtime's outputs",
                              " under offline: a frozen input or another source model in any section is refused in one line")]
    if ortweb_installed():
        expected += [f"{name} under offline: each compiled shape runs the source model and gives onnxruntime's outputs"
                     for name in ("specialized-widths", "specialized-seq")]
    expected.append("external-weights: a tampered weight file is refused at create, naming it and its CU")
    passed = set(re.findall(r"^ok \d+ - (.+)$", report, re.MULTILINE))
    assert not set(expected) - passed, report[-3000:]


@pytest.mark.slow
def test_node_runs_the_light_models_and_minilm(tmp_path):
    cases = [compiled_case(light_model(name), rtol=1e-3, atol=1e-4) for name in LIGHT_MODEL_NAMES]
    cases.append(compiled_case(minilm(1, 128), rtol=1e-3, atol=1e-4))
    run_node_tests(cases, tmp_path, "models.test.js")


BUNDLED_RUN = """
const [site] = process.argv.slice(1);
const { InferenceSession, exampleFeeds } = await import(`${site}/cortex-runtime/index.js`);
const session = await InferenceSession.create(`${site}/dag.json`);
const outputs = await session.run(exampleFeeds(session.inputMetadata));
console.log(JSON.stringify({specialization: session.specialization, inputs: session.inputMetadata,
  outputs: Object.fromEntries(Object.entries(outputs).map(([n, t]) => [n, {dims: t.dims, data: Array.from(t.data)}]))}));
"""


def _example_feeds(inputs: list[dict]) -> dict:
    """`cortex run --example-inputs`: floats arange(n) / n, integers zero."""
    feeds = {}
    for spec in inputs:
        n = int(np.prod(spec["shape"]))
        dtype = np.dtype(spec["dtype"])
        values = np.arange(n, dtype=np.float64) / max(n, 1) if dtype.kind == "f" else np.zeros(n)
        feeds[spec["name"]] = values.astype(dtype).reshape(spec["shape"])
    return feeds


@pytest.mark.parametrize("case", ["specialized-widths", "external-weights"])
def test_a_bundle_of_a_specialized_or_external_weights_build_runs_its_first_shape(tmp_path, case):
    case_json = {"specialized-widths": conv_widths_case, "external-weights": external_weights_case}[case]()
    dag = case_json.parent / json.loads(case_json.read_text())["dag"]
    site = tmp_path / "site"
    code, out, err = run_cli(["bundle", dag, "--output", site, "--json"])
    assert code == 0, err
    document = json.loads(dag.read_text())
    sections = document.get("specializations", [document])
    records = [cu["artifacts"]["wasm"] for s in sections for cu in s["cus"]]
    named = {r["path"] for r in records} | {w["path"] for r in records for w in r.get("weights", [])}
    copied = {str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()} - {"dag.json", "index.html", "main.js"}
    assert {p for p in copied if not p.startswith("cortex-runtime/")} == named        # each file once, nothing else
    assert json.loads(out)["files"] == len(named)
    done = subprocess.run([NODE, "--input-type=module", "-e", BUNDLED_RUN, str(site)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    ran = json.loads(done.stdout)
    first = sections[0]
    assert ran["specialization"] == first.get("name")
    assert [i["shape"] for i in ran["inputs"]] == [i["shape"] for i in first["inputs"]]
    feeds = _example_feeds(first["inputs"])
    want = cortex.load(dag).run(feeds)
    for name, value in want.items():
        assert ran["outputs"][name]["dims"] == list(value.shape)
        np.testing.assert_allclose(np.array(ran["outputs"][name]["data"], np.float32).reshape(value.shape), value,
                                   rtol=0, atol=0)


def test_bundle_refuses_a_tampered_weight_file_in_one_line_and_writes_nothing(tmp_path):
    case_json = external_weights_case()
    source = case_json.parent / "out"
    copy = tmp_path / "out"
    shutil.copytree(source, copy)
    record = json.loads((copy / "dag.json").read_text())["cus"][0]["artifacts"]["wasm"]
    weight = copy / record["weights"][0]["path"]
    data = bytearray(weight.read_bytes())
    data[0] ^= 1
    weight.write_bytes(bytes(data))
    code, _, err = run_cli(["bundle", copy / "dag.json", "--output", tmp_path / "site"])
    assert_one_line_error(code, err, weight.name, "sha256 differs")
    assert not (tmp_path / "site").exists()
