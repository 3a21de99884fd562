"""Reduced-precision variants: compile-wasm --variants stores the weights narrow (the artifact
bytes shrink), each variant computes what onnxruntime computes on the narrowed weights (int8's
products of more than two rows with their activations quantized per tensor, as DynamicQuantizeMatMul
does), and the runtime picks the most compact variant whose calibrated trust meets the policy's
threshold, never an uncalibrated one, with guards that rerun the exact CU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from testdata import run_onnxruntime as run_reference

import cortex
from backends.cuda.toolchain import find_nvcc
from cortex.runtime.policy import POLICIES, Policy
from cortex.runtime.variants import EQUALLY_COMPACT
from cortex.tools.calibrate import calibrate
from ir.errors import CortexError
from variant_cases import (ROWS, build, embedding_mlp, feeds, narrowed_reference, recompile, run_onnxruntime,
                           set_trust, weights)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return build(tmp_path_factory.mktemp("variants"))


def fresh_copy(bundle, tmp_path):
    """A private copy of the bundle, for tests that edit its dag.json."""
    shutil.copytree(bundle.parent, tmp_path / "b", symlinks=True)
    return tmp_path / "b" / "dag.json"


def test_variant_artifacts_hold_the_weights_at_half_and_a_quarter_the_bytes(bundle):
    dag = json.loads(bundle.read_text())
    exact = sum(cu["artifacts"]["wasm"]["bytes"] for cu in dag["cus"] if cu.get("variants"))
    sizes = {p: sum(cu["variants"][p]["artifacts"]["wasm"]["bytes"] for cu in dag["cus"] if cu.get("variants"))
             for p in ("fp16", "bf16", "int8")}
    # The weights are ~98% of the float32 bytes (code and the float32 bias are the rest), so the
    # ratios sit just above 0.5 and 0.25; the files on disk are the ones recorded. int8's products of
    # 8 rows run on the integer GEMM, whose B panels hold int16 k pairs: their weights take half of
    # float32's bytes, the table a quarter, (64000 + 2 * 32768) / (4 * 96768) = 0.335 in all.
    assert 0.48 < sizes["fp16"] / exact < 0.56 and 0.48 < sizes["bf16"] / exact < 0.56
    assert 0.32 < sizes["int8"] / exact < 0.38
    for cu in dag["cus"]:
        for variant in cu.get("variants", {}).values():
            record = variant["artifacts"]["wasm"]
            assert (bundle.parent / record["path"]).stat().st_size == record["bytes"]
            assert variant["trust"] is None          # never calibrated yet
    assert {cu["id"] for cu in dag["cus"] if cu.get("variants")} == \
           {cu["id"] for cu in dag["cus"] if {"Gather", "MatMul", "Gemm"} & set(cu["op_types"])}


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_each_variant_computes_the_model_on_its_narrowed_weights(bundle, tmp_path, precision):
    dag_path = fresh_copy(bundle, tmp_path)
    set_trust(dag_path, {precision: 1.0})
    model = cortex.load(dag_path, policy="balanced")
    w = weights()
    narrowed = (int8_products(w) if precision == "int8" else embedding_mlp(narrowed_reference(w, precision)))
    for feed in feeds(3, seed=7):
        got = model.run(feed)["y"]
        assert {e["precision"] for e in model.trace_document()["approximated_cus"]} == {precision}
        # Same arithmetic as onnxruntime on the narrowed weights up to float32 summation order.
        np.testing.assert_allclose(got, run_reference(narrowed, feed)["y"], rtol=1e-4, atol=1e-4)
        # And close to the float32 model: fp16 rounds each weight by at most 2^-11 relative, bf16 by
        # 2^-8, int8 by half a step of max|w|/127 per channel and each product's A by half a step of
        # its range / 255; over 64-256-term dot products of random signs the errors partly cancel,
        # so the output's relative L2 error stays below about the per-value bound (measured: fp16
        # 2e-4, bf16 2e-3, int8 1.2e-2 to 1.6e-2).
        exact = run_onnxruntime(embedding_mlp(w), feed)
        bound = {"fp16": 1e-3, "bf16": 8e-3, "int8": 3e-2}[precision]
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < bound


def int8_products(w: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The int8 variant's model: the table's int8 rows widened, and both products (ROWS > 2 rows) as
    onnxruntime's DynamicQuantizeMatMul on the weights' int8 codes per output channel."""
    assert ROWS > 2
    model = embedding_mlp(narrowed_reference(w, "int8"))
    graph = model.graph
    codes = {}
    for name, weight in (("w1", w["w1"]), ("w2", w["w2"].T)):     # [K, N]: w2 is Gemm's B with transB
        scale = np.abs(weight).max(axis=0) / np.float32(127)
        codes[name] = (np.clip(np.round(weight / scale), -127, 127).astype(np.int8), scale.astype(np.float32))
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm"):
            weight = node.input[1]
            node.CopyFrom(helper.make_node("DynamicQuantizeMatMul", [node.input[0], f"{weight}_codes", f"{weight}_scale"],
                                           list(node.output), domain="com.microsoft"))
            graph.initializer.extend([numpy_helper.from_array(codes[weight][0], f"{weight}_codes"),
                                      numpy_helper.from_array(codes[weight][1], f"{weight}_scale")])
    kept = [t for t in graph.initializer if t.name not in codes]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_uncalibrated_variants_never_run(bundle):
    for policy in ("balanced", "aggressive", POLICIES["aggressive"].with_threshold(0.0)):
        model = cortex.load(bundle, policy=policy)
        feed = feeds(1, seed=3)[0]
        got = model.run(feed)["y"]
        assert model.trace_document()["approximated_cus"] == []
        np.testing.assert_array_equal(got, cortex.load(bundle, policy="strict").run(feed)["y"])


def test_the_most_compact_variant_meeting_the_threshold_runs(bundle, tmp_path):
    dag_path = fresh_copy(bundle, tmp_path)
    set_trust(dag_path, {"fp16": 0.999, "bf16": 0.992, "int8": 0.97})
    dag = json.loads(dag_path.read_text())
    with_variants = [cu["id"] for cu in dag["cus"] if cu.get("variants")]
    # bf16 and fp16 store the same bytes of weights: where their modules are within EQUALLY_COMPACT of
    # each other (they differ by code), bf16 wins, since it widens by a shift; else the smaller module.
    def wasm_bytes(cu, precision):
        return cu["variants"][precision]["artifacts"]["wasm"]["bytes"]

    def compact_16(cu):
        bf16, fp16 = wasm_bytes(cu, "bf16"), wasm_bytes(cu, "fp16")
        return "bf16" if bf16 <= fp16 * (1 + EQUALLY_COMPACT) else "fp16"
    smaller_16 = {cu["id"]: compact_16(cu) for cu in dag["cus"] if cu.get("variants")}
    feed = feeds(1, seed=4)[0]
    expected = {"strict": None, "balanced": smaller_16, "aggressive": "int8",
                POLICIES["balanced"].with_threshold(0.995): "fp16",
                POLICIES["balanced"].with_threshold(0.9999): None}
    model = cortex.load(dag_path)
    for policy, precision in expected.items():
        model.run(feed, policy=policy)
        trace = model.trace_document()
        got = {(e["cu"], e["precision"]) for e in trace["approximated_cus"]}
        per_cu = precision if isinstance(precision, dict) else {cu: precision for cu in with_variants}
        assert got == {(cu, p) for cu, p in per_cu.items() if p}, policy
        assert trace["fell_back_cus"] == []
    model.run(feed, policy="aggressive")
    assert {(e["precision"], e["trust"]) for e in model.trace_document()["approximated_cus"]} == {("int8", 0.97)}


def test_an_out_of_range_input_trips_the_guard_and_reruns_the_exact_cu(bundle, tmp_path):
    dag_path = fresh_copy(bundle, tmp_path)
    np.savez(tmp_path / "calibration.npz", ids=np.stack([f["ids"] for f in feeds(6, 1)]),
             x=np.stack([f["x"] for f in feeds(6, 1)]))
    calibrate(dag_path, tmp_path / "calibration.npz")
    model = cortex.load(dag_path, policy=POLICIES["aggressive"].with_threshold(0.0))
    strict = cortex.load(dag_path, policy="strict")

    normal = feeds(1, seed=9)[0]
    model.run(normal)
    assert len(model.trace_document()["approximated_cus"]) == 3 and model.trace_document()["fell_back_cus"] == []

    wild = feeds(1, seed=9, scale=1000.0)[0]     # activations 1000x those calibrate saw
    got = model.run(wild)["y"]
    trace = model.trace_document()
    fell = {e["cu"]: e["reason"] for e in trace["fell_back_cus"]}
    assert fell, trace
    for reason in fell.values():
        assert "outside its calibrated range" in reason and "reran the exact CU" in reason
    assert not set(fell) & {e["cu"] for e in trace["approximated_cus"]}
    if len(fell) == 3:      # every CU reran exactly: the exact model's result, bit for bit
        np.testing.assert_array_equal(got, strict.run(wild)["y"])

    guards_off = cortex.load(dag_path, policy=Policy("unguarded", trust_threshold=0.0, guards=False))
    guards_off.run(wild)
    assert guards_off.trace_document()["fell_back_cus"] == []


def test_a_tampered_variant_module_is_refused(bundle, tmp_path):
    dag_path = fresh_copy(bundle, tmp_path)
    set_trust(dag_path, {"int8": 1.0})
    dag = json.loads(dag_path.read_text())
    cu = next(cu for cu in dag["cus"] if cu.get("variants"))
    module = dag_path.parent / cu["variants"]["int8"]["artifacts"]["wasm"]["path"]
    data = bytearray(module.read_bytes())
    data[-1] ^= 0xFF
    module.write_bytes(bytes(data))
    cortex.load(dag_path, policy="strict")           # the exact CUs alone are intact
    with pytest.raises(CortexError, match="sha256 differs"):
        cortex.load(dag_path, policy="balanced")


def test_a_variant_path_leaving_the_bundle_is_refused(bundle, tmp_path):
    dag_path = fresh_copy(bundle, tmp_path)
    dag = json.loads(dag_path.read_text())
    cu = next(cu for cu in dag["cus"] if cu.get("variants"))
    cu["variants"]["fp16"]["artifacts"]["wasm"]["path"] = "../elsewhere.wasm"
    dag_path.write_text(json.dumps(dag))
    with pytest.raises(CortexError, match="fp16 variant's wasm artifact: path '../elsewhere.wasm' leaves"):
        cortex.load(dag_path)


def test_recompiling_keeps_only_the_variants_asked_for_and_resets_changed_ones(tmp_path):
    dag_path = build(tmp_path, variants=("fp16", "int8"))
    set_trust(dag_path, {"fp16": 0.999, "int8": 0.98})
    recompile(tmp_path, variants=("fp16",))                  # the same bytes: fp16 keeps its trust
    dag = json.loads(dag_path.read_text())
    for cu in dag["cus"]:
        if cu.get("variants"):
            assert set(cu["variants"]) == {"fp16"} and cu["variants"]["fp16"]["trust"] == 0.999
    assert not list((tmp_path / "wasm-bin").glob("*-int8.wasm"))
    recompile(tmp_path, variants=("fp16",), opt_level="0")   # other code: measured on other bytes
    dag = json.loads(dag_path.read_text())
    assert all(cu["variants"]["fp16"]["trust"] is None for cu in dag["cus"] if cu.get("variants"))
    recompile(tmp_path, variants=())
    assert not any("variants" in cu for cu in json.loads(dag_path.read_text())["cus"])


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_cuda_variants_calibrate_and_run_on_cuda_sim(tmp_path):
    """compile-cuda --variants, calibrate on cuda-sim, and the choice by the weights' bytes (a CUDA
    record has no module size): aggressive runs int8, within its trust of the exact CU."""
    model_path = tmp_path / "model.onnx"
    onnx.save(embedding_mlp(weights(0)), model_path)
    cli = [str(Path(sys.executable).parent / "cortex")]
    run = lambda *argv: subprocess.run([*cli, *map(str, argv)], capture_output=True, text=True, check=True)  # noqa: E731
    run("decompose", "--model-path", model_path, "--output-dir", tmp_path / "cus", "--min-cu-size", 16, "--max-cu-depth", 1)
    run("build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "dag.json")
    run("compile-cuda", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "cuda-bin", "--dag", tmp_path / "dag.json",
        "--compiler", "nvrtc", "--variants", "fp16,int8")
    calibration = feeds(6, seed=1)
    np.savez(tmp_path / "feeds.npz", **{k: np.stack([f[k] for f in calibration]) for k in calibration[0]})
    run("calibrate", tmp_path / "dag.json", "--data", tmp_path / "feeds.npz", "--device", "cuda-sim")
    dag = json.loads((tmp_path / "dag.json").read_text())
    with_variants = [cu for cu in dag["cus"] if cu.get("variants")]
    assert with_variants and all(cu["variants"]["int8"]["trust"] >= 0.95 for cu in with_variants)
    feed = feeds(1, seed=9)[0]
    exact = cortex.load(tmp_path / "dag.json", device="cuda-sim", policy="strict").run(feed)
    model = cortex.load(tmp_path / "dag.json", device="cuda-sim", policy="aggressive")
    got = model.run(feed)
    assert {(e["cu"], e["precision"]) for e in model.last_trace["approximated_cus"]} == \
        {(cu["id"], "int8") for cu in with_variants}
    for name, value in exact.items():
        error = np.linalg.norm(got[name] - value) / np.linalg.norm(value)
        assert 0 < error < 0.05, (name, error)
