"""What the runtime counts for a MatMulNBits CU is its narrow bytes: the memory plan's weights, the
trace's resident bytes per CU and in the memory tiers, and what `--memory-budget` admits, each at
most 0.2x of the same product built as a float32 MatMul (4-bit codes, float32 scales per block of
32 and packed zero points: 5.25 bits a weight, 0.16x; the rest is the CU's activations and scratch,
rounded up to whole 64 KiB wasm pages)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from cli_helpers import assert_one_line_error, run_cli
from nbits_cases import large_product
from testdata import run_onnxruntime
from wasm_cases import compile_pipeline

import cortex

NARROW_RATIO = 0.2
# Between the 4-bit CU's memory (0.19 MB) and the float32 CU's (1.06 MB).
BUDGET_MB = 0.5


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The 4-bit product and its float32 twin, each compiled for wasm: {"narrow"|"float": dag.json}, and the feed."""
    narrow, twin, feeds = large_product()
    dags = {}
    for name, model in (("narrow", narrow), ("float", twin)):
        folder = tmp_path_factory.mktemp(name)
        onnx.save(model, folder / "model.onnx")
        dags[name] = compile_pipeline(folder / "model.onnx", folder, min_cu_size=1)
        np.savez(folder / "feeds.npz", **feeds)
    return dags, feeds


def _run_traced(dag, feeds) -> tuple[np.ndarray, dict]:
    model = cortex.load(dag, device="wasm", threads=1, memory_budget_mb=64)
    y = model.run(feeds)["y"]
    return y, model.trace_document()


def test_a_4_bit_cu_holds_at_most_a_fifth_of_the_float32_products_bytes(builds):
    dags, feeds = builds
    traces, plans = {}, {}
    for name, dag in dags.items():
        got, traces[name] = _run_traced(dag, feeds)
        want = run_onnxruntime(onnx.load(dag.parent / "model.onnx"), feeds)["y"]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
        (cu,) = json.loads(dag.read_text())["cus"]
        plans[name] = cu["artifacts"]["wasm"]["memory"]

    float_weight_bytes = 4 * np.prod(onnx.load(dags["float"].parent / "model.onnx").graph.initializer[0].dims)
    assert plans["float"]["weights_bytes"] >= float_weight_bytes
    assert plans["narrow"]["weights_bytes"] <= 0.17 * float_weight_bytes        # codes, scales and zero points
    per_cu = {name: sum(entry["resident_bytes"] for entry in trace["cus"]) for name, trace in traces.items()}
    tiers = {name: trace["memory"]["peak_resident_bytes"] for name, trace in traces.items()}
    for counted in (per_cu, tiers):
        assert counted["narrow"] >= plans["narrow"]["memory_bytes"]           # the whole plan is held, weights included
        assert counted["narrow"] <= NARROW_RATIO * counted["float"], counted


def test_a_memory_budget_admits_the_4_bit_cu_and_refuses_its_float32_twin(builds):
    dags, _ = builds
    outputs = {}
    for name, dag in dags.items():
        folder = dag.parent
        code, _, err = run_cli(["run", dag, "--input", folder / "feeds.npz", "--output", folder / "out.npz",
                                "--memory-budget", BUDGET_MB, "--trace", folder / "trace.json"])
        outputs[name] = (code, err)
    code, err = outputs["narrow"]
    assert code == 0, err
    trace = json.loads((dags["narrow"].parent / "trace.json").read_text())
    assert trace["memory"]["budget_bytes"] == int(BUDGET_MB * (1 << 20)) >= trace["memory"]["peak_resident_bytes"]
    assert_one_line_error(*outputs["float"], "--memory-budget", "cu-0000 holds 1.06 MB")
