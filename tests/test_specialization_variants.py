"""Reduced-precision variants of shape specializations: compile --variants builds them per
specialization (their narrow weights stored once across shapes), calibrate measures each
specialization on the feeds of its shapes, and a request runs the variants of the specialization
it picks only where those were calibrated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from cli_helpers import assert_one_line_error, run_cli
from cuda_cases import cuda_compiler_available
from test_cuda_specializations import VOCAB, attention_model

import cortex


def build(model: Path, out: Path, target: str, *compile_options: str) -> Path:
    for argv in (["decompose", "--model-path", model, "--output-dir", out / "cus", "--min-cu-size", "64",
                  "--dim", "seq=8,16"],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 [f"compile-{target}", "--cu-dir", out / "cus", "--output", out / f"{target}-bin",
                  "--dag", out / "dag.json", "--no-cache", *compile_options]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    return out / "dag.json"


def feed(seq: int, seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, VOCAB, (1, seq)).astype(np.int64)
    return {"ids": ids, "mask": np.ones_like(ids)}


def write_feeds(folder: Path, *feeds: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, one in enumerate(feeds):
        np.savez(folder / f"feed-{i}.npz", **one)
    return folder


def reference(model: Path, inputs: dict) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, inputs)[0]


def variants_of(dag: dict, name: str) -> dict[str, dict]:
    section = next(s for s in dag["specializations"] if s["name"] == name)
    return {f"{cu['id']} {p}": v for cu in section["cus"] for p, v in cu.get("variants", {}).items()}


@pytest.fixture(scope="module")
def wasm_bundle(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("variants")
    model = attention_model(root / "attention.onnx")
    return model, build(model, root / "out", "wasm", "--variants", "fp16")


def test_a_calibration_feed_of_no_compiled_shape_is_one_line_and_writes_nothing(wasm_bundle, tmp_path):
    _, dag_path = wasm_bundle
    before = dag_path.read_bytes()
    data = write_feeds(tmp_path / "feeds", feed(8, 1), feed(5, 2))
    code, _, err = run_cli(["calibrate", dag_path, "--data", data])
    assert_one_line_error(code, err, "feed-1.npz", "ids=1x5", "match no shape specialization", "seq=8", "seq=16")
    assert dag_path.read_bytes() == before


def test_variants_are_built_calibrated_and_run_per_specialization(wasm_bundle, tmp_path):
    model, dag_path = wasm_bundle
    dag = json.loads(dag_path.read_text())
    for name in ("seq=8", "seq=16"):
        assert variants_of(dag, name) and all(v["trust"] is None for v in variants_of(dag, name).values())
    # The fp16 embedding is the same for both shapes: one file.
    narrow = [{w["path"] for cu in s["cus"] if "variants" in cu
               for w in cu["variants"]["fp16"]["artifacts"]["wasm"]["weights"]} for s in dag["specializations"]]
    assert narrow[0] & narrow[1]

    data = write_feeds(tmp_path / "feeds", feed(8, 1), feed(8, 2))
    code, printed, err = run_cli(["calibrate", dag_path, "--data", data, "--json"])
    assert code == 0, err
    summary = json.loads(printed)
    assert summary["specializations"] == {"seq=8": 2, "seq=16": 0}
    calibrated = json.loads(dag_path.read_text())
    assert all(v["trust"] is not None and v["trust"] > 0.99 for v in variants_of(calibrated, "seq=8").values())
    assert all(v["trust"] is None for v in variants_of(calibrated, "seq=16").values())

    compiled = cortex.load(dag_path, policy="aggressive")
    seen = feed(8, 1)         # a calibration feed: inside the guards' ranges
    got = compiled.run(seen)["y"]
    assert compiled.specialization == "seq=8"
    assert {e["precision"] for e in compiled.last_trace["approximated_cus"]} == {"fp16"}
    np.testing.assert_allclose(got, reference(model, seen), rtol=2e-2, atol=2e-2)
    longer = feed(16, 4)
    got = compiled.run(longer)["y"]
    assert compiled.specialization == "seq=16" and compiled.last_trace["approximated_cus"] == []
    np.testing.assert_allclose(got, reference(model, longer), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not cuda_compiler_available(), reason="no CUDA compiler (nvcc or NVRTC)")
def test_cuda_variants_of_specializations_run_on_cuda_sim_after_calibration(tmp_path):
    model = attention_model(tmp_path / "attention.onnx")
    dag_path = build(model, tmp_path / "out", "cuda", "--variants", "fp16", "--arch", "sm_80")
    data = write_feeds(tmp_path / "feeds", feed(16, 1))
    code, printed, err = run_cli(["calibrate", dag_path, "--data", data, "--device", "cuda-sim", "--json"])
    assert code == 0, err
    assert json.loads(printed)["specializations"] == {"seq=8": 0, "seq=16": 1}
    compiled = cortex.load(dag_path, device="cuda-sim", policy="aggressive")
    inputs = feed(16, 1)      # the calibration feed: inside the guards' ranges
    got = compiled.run(inputs)["y"]
    assert compiled.specialization == "seq=16"
    assert {e["precision"] for e in compiled.last_trace["approximated_cus"]} == {"fp16"}
    assert compiled.run(feed(8, 1))["y"].shape == (1, 8, 16) and compiled.last_trace["approximated_cus"] == []
    np.testing.assert_allclose(got, reference(model, inputs), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.skipif(not cuda_compiler_available(), reason="no CUDA compiler (nvcc or NVRTC)")
def test_tf32_variants_of_specializations_share_the_exact_weights_and_the_compile_cache(tmp_path):
    """compile-cuda --variants tf32 over two batch sizes: each tf32 variant names the exact CU's
    weight files (the same bytes, stored once), a second compile takes every CU and variant from the
    cache, and only the specialization that was calibrated runs its tf32 variants."""
    from testdata import sample_model

    case, out, cache = sample_model("mlp"), tmp_path / "out", tmp_path / "cache"
    for argv in (["decompose", "--model-path", case.path, "--output-dir", out / "cus", "--dim", "batch=16,32",
                  "--min-cu-size", "16", "--max-cu-depth", "1"],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    compile_cuda = ["compile-cuda", "--cu-dir", out / "cus", "--output", out / "cuda-bin", "--dag", out / "dag.json",
                    "--compiler", "nvrtc", "--arch", "sm_90", "--variants", "tf32", "--cache-dir", cache, "--json"]
    summaries = []
    for _ in range(2):
        code, printed, err = run_cli(compile_cuda)
        assert code == 0, err
        summaries.append(json.loads(printed))
    assert summaries[0]["compiled_cus"] == 6 and summaries[1]["reused_cus"] == 6
    assert summaries[0]["variant_bytes"] == summaries[1]["variant_bytes"]
    dag_path = out / "dag.json"
    dag = json.loads(dag_path.read_text())
    for section in dag["specializations"]:
        with_tf32 = [cu for cu in section["cus"] if "tf32" in cu.get("variants", {})]
        assert len(with_tf32) == 2
        for cu in with_tf32:
            assert cu["variants"]["tf32"]["artifacts"]["cuda"]["weights"] == cu["artifacts"]["cuda"]["weights"]
    x = np.random.default_rng(3).standard_normal((2, 32, 64)).astype(np.float32)
    np.savez(tmp_path / "feeds.npz", x=x)
    code, _, err = run_cli(["calibrate", dag_path, "--data", tmp_path / "feeds.npz", "--device", "cuda-sim"])
    assert code == 0, err
    assert all(v["trust"] > 0.99 for v in variants_of(json.loads(dag_path.read_text()), "batch=32").values())
    assert all(v["trust"] is None for v in variants_of(json.loads(dag_path.read_text()), "batch=16").values())
    compiled = cortex.load(dag_path, device="cuda-sim", policy="aggressive")
    got = compiled.run({"x": x[0]})["y"]
    assert {e["precision"] for e in compiled.last_trace["approximated_cus"]} == {"tf32"}
    np.testing.assert_allclose(got, reference(case.path, {"x": x[0]}), rtol=2e-3, atol=2e-3)
    compiled.run({"x": x[0, :16]})
    assert compiled.specialization == "batch=16" and compiled.last_trace["approximated_cus"] == []
