"""`cortex calibrate`: per variant its agreement with the exact CU, its end-to-end effect and its
trust; per CU its observed output ranges and activation count; one-line errors for bad data."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from cli_helpers import assert_one_line_error, run_cli
import cortex
from cortex.dag import read_dag
from cortex.tools.calibrate import calibrate, relative_l2
from variant_cases import build, embedding_mlp, feeds, narrowed_reference, run_onnxruntime, weights


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return build(tmp_path_factory.mktemp("calibrate"))


@pytest.fixture
def copy(bundle, tmp_path):
    shutil.copytree(bundle.parent, tmp_path / "b", symlinks=True)
    return tmp_path / "b" / "dag.json"


def save_batched(path, batch: list[dict]) -> None:
    np.savez(path, **{name: np.stack([f[name] for f in batch]) for name in batch[0]})


def test_calibrate_records_trust_agreement_ranges_and_activations(copy, tmp_path):
    batch = feeds(5, seed=11)
    save_batched(tmp_path / "cal.npz", batch)
    calibrate(copy, tmp_path / "cal.npz")
    dag = read_dag(copy)                                  # still a valid dag.json (schema + checks)
    w = weights()
    exact_outputs = [run_onnxruntime(embedding_mlp(w), f) for f in batch]
    for cu in dag["cus"]:
        assert cu["calibration"]["samples"] == 5 and cu["calibration"]["activations"] == 5
        if "y" in cu["outputs"]:            # the model's output: its range is onnxruntime's
            observed = cu["calibration"]["outputs"]["y"]
            assert observed["min"] == pytest.approx(min(o.min() for o in exact_outputs), abs=1e-4)
            assert observed["max"] == pytest.approx(max(o.max() for o in exact_outputs), abs=1e-4)
        for precision, variant in cu.get("variants", {}).items():
            agreement = variant["agreement"]
            assert 0.0 <= variant["trust"] <= 1.0 and agreement["samples"] == 5
            assert variant["trust"] == pytest.approx(1.0 - agreement["worst_relative_l2"])
            assert agreement["mean_relative_l2"] <= agreement["worst_relative_l2"]
            assert set(variant["end_to_end"]) == {"y"}
    # The last CU's variant alone swapped in changes y by exactly what its own outputs differ, and
    # more compact means less trust on these Gaussian weights: fp16 > bf16 > int8.
    last = next(cu for cu in dag["cus"] if "y" in cu["outputs"])
    for variant in last["variants"].values():
        assert variant["end_to_end"]["y"]["worst_relative_l2"] == pytest.approx(
            variant["agreement"]["worst_relative_l2"], rel=1e-6)
    trust = {p: min(cu["variants"][p]["trust"] for cu in dag["cus"] if cu.get("variants")) for p in ("fp16", "bf16", "int8")}
    assert trust["fp16"] > trust["bf16"] > trust["int8"] > 0.9


def test_end_to_end_effect_matches_onnxruntime_on_the_narrowed_model(copy, tmp_path):
    """With every CU's int8 variant measured alone, the worst single-CU end-to-end error is at most
    the error of all of them at once (computed independently with onnxruntime) plus slack."""
    batch = feeds(4, seed=12)
    save_batched(tmp_path / "cal.npz", batch)
    calibrate(copy, tmp_path / "cal.npz")
    dag = json.loads(copy.read_text())
    w = weights()
    all_narrowed = max(relative_l2(run_onnxruntime(embedding_mlp(narrowed_reference(w, "int8")), f),
                                   run_onnxruntime(embedding_mlp(w), f)) for f in batch)
    single = [cu["variants"]["int8"]["end_to_end"]["y"]["worst_relative_l2"] for cu in dag["cus"] if cu.get("variants")]
    assert 0 < max(single) <= all_narrowed * 1.5


def test_a_folder_of_feeds_and_one_batched_file_calibrate_alike(bundle, tmp_path):
    batch = feeds(3, seed=13)
    first, second = tmp_path / "one", tmp_path / "two"
    for where in (first, second):
        shutil.copytree(bundle.parent, where, symlinks=True)
    save_batched(tmp_path / "cal.npz", batch)
    (tmp_path / "feeds").mkdir()
    for i, f in enumerate(batch):
        np.savez(tmp_path / "feeds" / f"{i:02d}.npz", **f)
    calibrate(first / "dag.json", tmp_path / "cal.npz")
    calibrate(second / "dag.json", tmp_path / "feeds")
    a, b = (json.loads((d / "dag.json").read_text()) for d in (first, second))
    assert [cu.get("variants") for cu in a["cus"]] == [cu.get("variants") for cu in b["cus"]]
    assert [cu["calibration"] for cu in a["cus"]] == [cu["calibration"] for cu in b["cus"]]


def test_cli_calibrate_then_a_second_run_from_the_cli(copy, tmp_path):
    save_batched(tmp_path / "cal.npz", feeds(2, seed=14))
    code, out, err = run_cli(["calibrate", copy, "--data", tmp_path / "cal.npz", "--json"])
    assert code == 0, err
    summary = json.loads(out)
    assert summary["feeds"] == 2 and all(0 <= t <= 1 for t in summary["variants"].values())
    assert all(v["trust"] is not None for cu in json.loads(copy.read_text())["cus"] for v in cu.get("variants", {}).values())


def test_cli_calibrate_errors_are_one_line(copy, tmp_path):
    good = feeds(2, seed=15)
    (tmp_path / "bad.npz").write_bytes(b"not a zip file")
    np.savez(tmp_path / "missing.npz", ids=np.stack([f["ids"] for f in good]))
    np.savez(tmp_path / "shape.npz", ids=np.stack([f["ids"] for f in good]), x=np.zeros((2, 3, 3), np.float32))
    np.savez(tmp_path / "dtype.npz", ids=np.stack([f["ids"] for f in good]).astype(np.int32),
             x=np.stack([f["x"] for f in good]))
    (tmp_path / "empty").mkdir()
    cases = {"bad.npz": "not a readable .npz file", "missing.npz": "missing input 'x'",
             "shape.npz": "input 'x' has shape [2, 3, 3], the model expects [8, 64]",
             "dtype.npz": "input 'ids' has dtype int32", "empty": "holds no .npz files",
             "nothing-here.npz": "no such file or folder"}
    for name, fragment in cases.items():
        code, _, err = run_cli(["calibrate", copy, "--data", tmp_path / name])
        assert_one_line_error(code, err, f"--data {tmp_path / name}", fragment)
    before = copy.read_bytes()

    no_variants = tmp_path / "plain"
    cli_pipeline(no_variants)
    save_batched(tmp_path / "good.npz", good)
    # Without variants calibrate still records each CU's speed: the hot CUs a memory budget pins.
    code, out, err = run_cli(["calibrate", no_variants / "dag.json", "--data", tmp_path / "good.npz", "--json"])
    assert code == 0, err
    plain = json.loads((no_variants / "dag.json").read_text())
    assert json.loads(out)["variants"] == {}
    assert json.loads(out)["hot_cus"] == [cu["id"] for cu in plain["cus"] if cu["residency"]["hot"]]
    assert all(cu["residency"]["load_ms"] > 0 and "variants" not in cu for cu in plain["cus"])
    hot = {cu["id"] for cu in plain["cus"] if cu["residency"]["hot"]}
    budgeted = cortex.load(no_variants / "dag.json", memory_budget_mb=64.0)
    budgeted.run(good[0])
    assert set(budgeted.last_trace["memory"]["pinned_cus"]) == hot     # room for all: every hot CU pinned
    code, _, err = run_cli(["compile-wasm", "--cu-dir", no_variants / "cus", "--output", no_variants / "wasm-bin",
                            "--dag", no_variants / "dag.json", "--variants", "fp16,fp8"])
    assert_one_line_error(code, err, "unknown --variants fp8")
    assert copy.read_bytes() == before                   # a failed calibrate leaves dag.json as it was


def cli_pipeline(folder, *compile_flags) -> str:
    """decompose, build-dag and compile-wasm as a user runs them; compile-wasm's stdout."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(embedding_mlp(weights()), folder / "model.onnx")
    for argv in (["decompose", "--model-path", folder / "model.onnx", "--output-dir", folder / "cus"],
                 ["build-dag", "--cu-dir", folder / "cus", "--output", folder / "dag.json"],
                 ["compile-wasm", "--cu-dir", folder / "cus", "--output", folder / "wasm-bin",
                  "--dag", folder / "dag.json", *compile_flags]):
        code, out, err = run_cli(argv)
        assert code == 0, err
    return out


def test_compile_wasm_cli_builds_the_variants(tmp_path):
    summary = json.loads(cli_pipeline(tmp_path, "--variants", "int8,fp16", "--json"))
    assert set(summary["variant_bytes"]) == {"int8", "fp16"}
    assert summary["variant_bytes"]["int8"] < summary["variant_bytes"]["fp16"] < summary["bytes"]
    dag = read_dag(tmp_path / "dag.json")
    assert any(set(cu.get("variants", {})) == {"fp16", "int8"} for cu in dag["cus"])
