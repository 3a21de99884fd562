"""The result cache keys only CUs where a hit is possible: in a dag.json built with
`decompose --cache-inputs`, the repeating CUs (and CUs whose inputs all chain from keyed ones);
a CU reading an input that changes with every request is neither hash_calls nor stored, and its
outputs stay bit for bit those of `strict`."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import cortex
from cli_helpers import run_cli
from test_cache_inputs import cache_model, feeds
from testdata import run_onnxruntime


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    out = tmp_path_factory.mktemp("marked")
    onnx.save(cache_model(), out / "m.onnx")
    for argv in (["decompose", "--model-path", out / "m.onnx", "--output-dir", out / "cus", "--min-cu-size", "100000",
                  "--max-cu-depth", "8", "--cache-inputs", "m,mask"],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 ["compile-wasm", "--cu-dir", out / "cus", "--output", out / "wasm-bin", "--dag", out / "dag.json"]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    return out / "m.onnx", out / "dag.json"


def test_only_repeating_cus_are_hash_calls_and_stored(marked, hash_calls):
    model_path, dag_path = marked
    model, strict = cortex.load(dag_path, threads=1), cortex.load(dag_path, policy="strict", threads=1)
    repeating = [cu["id"] for cu in model.dag["cus"] if cu.get("cache") == "repeating"]
    changing = [cu["id"] for cu in model.dag["cus"] if cu.get("cache") != "repeating"]
    assert repeating and changing
    first = feeds(1)
    for seed in (1, 2, 3):           # m and mask repeat, x changes
        f = {**first, "x": feeds(seed)["x"]}
        got = model.run(f)
        np.testing.assert_array_equal(got["y"], strict.run(f)["y"])
        np.testing.assert_allclose(got["y"], run_onnxruntime(model_path, f)["y"], rtol=1e-5, atol=1e-6)
        hits = [s["cu"] for s in model.last_trace["skipped_cus"] if s["reason"] == "cache hit"]
        assert hits == ([] if seed == 1 else repeating)
        assert model.last_trace["activated_cus"] == (model.dag["order"] if seed == 1 else changing)
        # x is never hash_calls: no CU reading it can hit.
        assert not any(a.shape == f["x"].shape and np.array_equal(a, f["x"]) for a in hash_calls)
    assert len(model.cache.entries) == len(repeating)
    assert model.cache.stats()["misses"] == len(repeating)


def test_a_repeated_request_still_hits_its_repeating_cus_only(marked):
    _, dag_path = marked
    model = cortex.load(dag_path, threads=1)
    model.run(feeds(4))
    model.run(feeds(4))
    repeating = {cu["id"] for cu in model.dag["cus"] if cu.get("cache") == "repeating"}
    assert {s["cu"] for s in model.last_trace["skipped_cus"]} == repeating
