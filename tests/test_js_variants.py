"""Reduced-precision variants and the offline policy in the JavaScript runtime, on a model compiled
with `compile-wasm --variants` and calibrated with `cortex calibrate`: for each policy and trust
threshold the Python runtime writes the variants it picked per CU, the guards that fired and its
outputs, and js/test/variants.test.js checks that the JS runtime does the same; offline runs the
source model on onnxruntime-web against onnxruntime. Bundles carry the variant modules, and the
source model with --with-source."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess

import numpy as np
import onnx
import pytest
from cli_helpers import assert_one_line_error, run_cli
from js_cases import (
    CASES_DIR,
    NODE,
    ORTWEB_DIR,
    ortweb_installed,
    run_node_tests,
    write_case,
)
from variant_cases import build, feeds, run_onnxruntime

import cortex
from cortex.runtime.policy import policy
from samples.cache import ensure_folder

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

# (name, dag file, policy, trust threshold or absent). The calibrated trusts of this model lie
# near fp16 0.9998, bf16 0.998, int8 0.9904-0.9918 per CU (the table's Gather weight-only, the
# products with their activations quantized at run time), so these pick int8 everywhere, bf16
# and int8 mixed by CU, fp16 everywhere, nothing, and, in the guarded copy, bf16 where int8 is
# uncalibrated and a fallback where the calibrated range was narrowed.
RUNS = [("calibrated", "dag.json", "balanced", None), ("calibrated", "dag.json", "aggressive", None),
        ("calibrated", "dag.json", "balanced", 0.9912), ("calibrated", "dag.json", "aggressive", 0.9995),
        ("calibrated", "dag.json", "balanced", 0.99999), ("calibrated", "dag.json", "strict", None),
        ("guarded", "guarded.json", "balanced", None)]
RTOL, ATOL = 1e-5, 1e-6


def _guarded_copy(dag_path):
    """dag.json with one CU's int8 variant uncalibrated and the Gemm's calibrated range narrowed
    so that its guard fires (the other CUs keep theirs)."""
    dag = json.loads(dag_path.read_text())
    cus = {cu["id"]: cu for cu in dag["cus"]}
    cus["cu-0000"]["variants"]["int8"]["trust"] = None
    gemm = next(cu for cu in dag["cus"] if "Gemm" in cu["op_types"])
    gemm["calibration"]["outputs"]["y"] = {"min": -0.5, "max": 0.5}
    target = dag_path.parent / "guarded.json"
    target.write_text(json.dumps(dag, indent=1))
    return target


def variants_case():
    def make(tmp):
        dag = build(tmp)
        calibration = feeds(4, seed=11)
        np.savez(tmp / "calibration.npz", **{k: np.stack([f[k] for f in calibration]) for k in calibration[0]})
        code, _, err = run_cli(["calibrate", dag, "--data", tmp / "calibration.npz"])
        assert code == 0, err
        _guarded_copy(dag)
        requests = feeds(2, seed=5)
        source = onnx.load(tmp / "model.onnx")
        offline = [{"inputs": f, "outputs": {"y": run_onnxruntime(source, f)}} for f in requests]
        write_case(tmp, "embedding-mlp", dag, offline, RTOL, ATOL)
        case = json.loads((tmp / "case.json").read_text())
        runs = []
        for k, (name, dag_file, policy_name, threshold) in enumerate(RUNS):
            chosen = policy(policy_name) if threshold is None else policy(policy_name).with_threshold(threshold)
            model = cortex.load(tmp / dag_file, policy=chosen, threads=1)
            described, approximated, fell_back = [], [], []
            for i, feed in enumerate(requests):
                outputs = model.run(feed)
                trace = model.trace_document()
                approximated.append(trace["approximated_cus"])
                fell_back.append(trace["fell_back_cus"])
                stem = f"v{k}-{i}"
                np.asarray(outputs["y"], "<f4").tofile(tmp / f"{stem}-y.bin")
                described.append({"inputs": case["requests"][i]["inputs"],
                                  "outputs": {"y": {"dtype": "float32", "shape": list(outputs["y"].shape),
                                                    "file": f"{stem}-y.bin"}}})
            runs.append({"name": name, "dag": dag_file, "policy": policy_name, "requests": described,
                         "approximated": approximated, "fell_back": fell_back,
                         **({} if threshold is None else {"trust_threshold": threshold})})
        record = json.loads(dag.read_text())["source_model"]
        case.update(variant_runs=runs, offline={"requests": case["requests"], "model": record["path"],
                                                "sha256": record["sha256"]})
        (tmp / "case.json").write_text(json.dumps(case, indent=1))
    runs_key = hashlib.sha256(json.dumps(RUNS).encode()).hexdigest()[:8]     # a changed RUNS rebuilds the case
    return ensure_folder(CASES_DIR / f"variants-embedding-mlp-{runs_key}", make) / "case.json"


def test_the_case_covers_every_kind_of_pick():
    runs = json.loads(variants_case().read_text())["variant_runs"]
    picks = [{a["precision"] for a in run["approximated"][0]} for run in runs]
    assert picks[:6] == [{"int8"}, {"int8"}, {"int8", "bf16"}, {"fp16"}, set(), set()]
    assert picks[6] == {"bf16", "int8"} and "cu-0000" in {a["cu"] for a in runs[6]["approximated"][0]}
    [guard] = runs[6]["fell_back"][0]
    assert guard["reason"].startswith("guard on the int8 variant: y spans [")


def test_node_picks_the_python_runtimes_variants_and_runs_offline(tmp_path):
    report = run_node_tests([variants_case()], tmp_path, "variants.test.js")
    passed = set(re.findall(r"^ok \d+ - (.+)$", report, re.MULTILINE))
    skipped = set(re.findall(r"^ok \d+ - (.+) # SKIP", report, re.MULTILINE))
    picks = [t for t in passed if "the Python runtime's variant picks, guards and outputs" in t]
    assert len(picks) == len(RUNS), report[-3000:]
    offline = {t for t in passed if "offline" in t}
    assert len(offline) == 3, report[-3000:]
    if ortweb_installed():           # the onnxruntime-web tests ran, not skipped
        assert not {t for t in skipped if "offline" in t}, report[-3000:]


BUNDLED_OFFLINE = """
const [site, ortweb, inputs] = process.argv.slice(1);
const { createRequire } = await import("node:module");
const { InferenceSession, Tensor } = await import(`${site}/cortex-runtime/index.js`);
let ort = null;
if (ortweb) {
  const mod = await import(createRequire(`${ortweb}/package.json`).resolve("onnxruntime-web"));
  ort = mod.InferenceSession ? mod : mod.default;
  ort.env.wasm.numThreads = 1;
}
const given = JSON.parse(inputs);
const feeds = Object.fromEntries(Object.entries(given).map(([n, t]) => [n, new Tensor(t.dtype,
  t.dtype === "int64" ? BigInt64Array.from(t.data, BigInt) : Float32Array.from(t.data), t.shape)]));
const said = {};
for (const policy of ["balanced", "offline"]) {
  try {
    const session = await InferenceSession.create(`${site}/dag.json`, { onnxruntime: ort });
    const y = (await session.run(feeds, { policy })).y;
    said[policy] = { y: Array.from(y.data), approximated: session.lastTrace.approximated_cus };
  } catch (e) {
    said[policy] = { error: `${e.name}: ${e.message}` };
  }
}
console.log(JSON.stringify(said));
"""


def _bundled_run(site, feed) -> dict:
    inputs = json.dumps({n: {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.ravel().tolist()}
                         for n, a in feed.items()})
    ortweb = str(ORTWEB_DIR) if ortweb_installed() else ""
    done = subprocess.run([NODE, "--input-type=module", "-e", BUNDLED_OFFLINE, str(site), ortweb, inputs],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_bundle_carries_the_variants_and_with_source_the_source_model(tmp_path):
    case = json.loads(variants_case().read_text())
    dag = variants_case().parent / case["dag"]
    document = json.loads(dag.read_text())
    feed = feeds(1, seed=5)[0]
    expected = np.fromfile(variants_case().parent / case["variant_runs"][0]["requests"][0]["outputs"]["y"]["file"],
                           "<f4")
    for with_source in (False, True):
        site = tmp_path / f"site-{with_source}"
        code, out, err = run_cli(["bundle", dag, "--output", site, "--json", *(["--with-source"] * with_source)])
        assert code == 0, err
        bundled = json.loads((site / "dag.json").read_text())
        for cu, original in zip(bundled["cus"], document["cus"]):
            assert cu.get("variants") == original.get("variants")
            for variant in cu.get("variants", {}).values():
                assert (site / variant["artifacts"]["wasm"]["path"]).read_bytes() == \
                       (dag.parent / variant["artifacts"]["wasm"]["path"]).read_bytes()
        said = _bundled_run(site, feed)
        np.testing.assert_allclose(said["balanced"]["y"], expected, rtol=RTOL, atol=ATOL)   # the int8 picks
        assert said["balanced"]["approximated"] == case["variant_runs"][0]["approximated"][0]
        if with_source:
            assert json.loads(out)["source_model"] == "source/model.onnx"
            assert bundled["source_model"] == {"path": "source/model.onnx", "sha256": document["source_model"]["sha256"]}
            assert (site / "source" / "model.onnx").read_bytes() == (dag.parent / "model.onnx").read_bytes()
            if ortweb_installed():
                np.testing.assert_allclose(said["offline"]["y"], run_onnxruntime(onnx.load(dag.parent / "model.onnx"),
                                                                                  feed).ravel(), rtol=RTOL, atol=ATOL)
        else:
            assert "source_model" not in bundled and not (site / "source").exists()
            if ortweb_installed():
                assert said["offline"]["error"].startswith("CortexError: ")
                assert "records no source model" in said["offline"]["error"]
                assert "cortex bundle --with-source" in said["offline"]["error"]


def test_with_source_refuses_a_missing_or_changed_source_model_in_one_line(tmp_path):
    dag = variants_case().parent / json.loads(variants_case().read_text())["dag"]
    copy = tmp_path / "model"
    copy.mkdir()
    document = json.loads(dag.read_text())
    (copy / "dag.json").write_text(json.dumps(document))
    for cu in document["cus"]:
        for record in [cu["artifacts"]["wasm"], *(v["artifacts"]["wasm"] for v in cu.get("variants", {}).values())]:
            (copy / record["path"]).parent.mkdir(parents=True, exist_ok=True)
            (copy / record["path"]).write_bytes((dag.parent / record["path"]).read_bytes())
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", copy / "dag.json", "--output", site, "--with-source"])
    assert_one_line_error(code, err, "model.onnx", "missing")
    (copy / "model.onnx").write_bytes((dag.parent / "model.onnx").read_bytes() + b"\0")
    code, _, err = run_cli(["bundle", copy / "dag.json", "--output", site, "--with-source"])
    assert_one_line_error(code, err, "model.onnx", "sha256 differs")
    code, _, err = run_cli(["bundle", dag, "--output", site, "--with-source", "--onnxruntime-web", tmp_path])
    assert_one_line_error(code, err, "--onnxruntime-web", "no dist/ort.wasm.bundle.min.mjs", "node_modules/onnxruntime-web")
    (copy / "dag.json").write_text(json.dumps({k: v for k, v in document.items() if k != "source_model"}))
    code, _, err = run_cli(["bundle", copy / "dag.json", "--output", site, "--with-source"])
    assert_one_line_error(code, err, "--with-source", "records no source model")
    assert not site.exists()
