"""MatMulNBits in the JavaScript runtime: models of 4-bit (zero points, blocks of 32) and 8-bit
(blocks of 16) nodes, K a multiple of neither block, on the GEMM's tiles and on the block kernel
(tests/nbits_cases.py), at accuracy levels 0 and 4, compiled for wasm (level 4 with and without
relaxed SIMD, whose dot product the block kernel then uses for 4-bit codes), run by
js/test/nbits.test.js against onnxruntime within each level's bound; and a 4-bit product beside its
float32 twin, whose CU the JS trace must count at the Python runtime's narrow bytes, at most 0.2x
the twin's. js/test/models.test.js runs the same cases under strict and balanced."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from js_cases import NODE, run_node_tests, write_case
from nbits_cases import NODES, dequantized, large_product, nbits_nodes
from onnx import numpy_helper
from testdata import run_onnxruntime
from wasm_cases import compile_pipeline

import cortex

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

SIMD, RELAXED = "simd,bulk-memory", "simd,bulk-memory,relaxed-simd"
LEVEL_4_SHARE_OF_MAX = 1e-6       # int8 A as MLAS quantizes it: the integer sums are exact
FLOAT32_ULPS = 4                  # levels 0-3: float32 rounding of sum_k |a w|, in units of its epsilon
NARROW_RATIO = 0.2


def level_0_bounds(model: onnx.ModelProto, feeds: dict) -> dict[str, float]:
    """Per output: FLOAT32_ULPS epsilons of the largest sum_k |a| |w| (w as the node dequantizes it)."""
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    bounds = {}
    for x, y, bits, k, n, block, _, _ in NODES:
        weight = {key: weights[f"{y}_{key}"] for key in ("b", "s", "zp") if f"{y}_{key}" in weights}
        magnitude = np.abs(feeds[x]) @ np.abs(dequantized(weight, bits, k, n, block))
        bounds[y] = float(FLOAT32_ULPS * np.finfo(np.float32).eps * magnitude.max())
    return bounds


def level_4_bounds(outputs: dict) -> dict[str, float]:
    return {name: float(LEVEL_4_SHARE_OF_MAX * np.abs(value).max()) for name, value in outputs.items()}


def _compiled(folder, model: onnx.ModelProto, features: str):
    folder.mkdir()
    onnx.save(model, folder / "model.onnx")
    return compile_pipeline(folder / "model.onnx", folder, features, min_cu_size=1, max_cu_depth=1)


def _python_run(dag, feeds) -> tuple[dict, dict[str, int]]:
    """The Python runtime's outputs and each CU's resident bytes, as its trace reports them."""
    model = cortex.load(dag, device="wasm", policy="strict", threads=1)
    outputs = model.run(feeds)
    return outputs, {entry["cu"]: entry["resident_bytes"] for entry in model.trace_document()["cus"]}


def _case(folder, name: str, dag, feeds: dict, want: dict, bounds: dict, level: int, **extra):
    """A case.json for js/test/: onnxruntime's outputs, each output's bound, and the Python runtime's
    resident bytes per CU (checked here first to meet the same bounds)."""
    got, resident = _python_run(dag, feeds)
    for output, bound in bounds.items():
        np.testing.assert_allclose(got[output], want[output], rtol=0, atol=bound, err_msg=f"{name} {output}")
    case = write_case(folder, name, dag, [{"inputs": feeds, "outputs": want}], 0.0, max(bounds.values()))
    document = json.loads(case.read_text())
    document["nbits"] = {"accuracy_level": level, "atol": bounds, "resident_bytes": resident, **extra}
    case.write_text(json.dumps(document, indent=1))
    return case


def nodes_case(root, level: int, features: str):
    """nbits_nodes at `level` compiled with `features`, against onnxruntime within the level's bound."""
    models = {lv: nbits_nodes(lv) for lv in (0, 4)}      # the same codes and feeds at both levels
    references = {lv: run_onnxruntime(*built) for lv, built in models.items()}
    model, feeds = models[level]
    bounds = level_0_bounds(model, feeds) if level == 0 else level_4_bounds(references[4])
    # The two levels' references differ far beyond either bound: a run at the wrong level fails.
    for output, bound in bounds.items():
        assert np.abs(references[0][output] - references[4][output]).max() > 100 * bound, output
    name = f"nbits-level-{level}-{features.replace(',', '-')}"
    dag = _compiled(root / name, model, features)
    return _case(root / name, name, dag, feeds, references[level], bounds, level)


def large_case(root):
    """The 4-bit product at level 4 and its float32 twin, compiled side by side."""
    narrow, twin, feeds = large_product()
    folder = root / "nbits-large"
    dag = _compiled(folder, narrow, SIMD)
    float_dag = _compiled(folder / "float", twin, SIMD)
    want = run_onnxruntime(narrow, feeds)
    return _case(folder, "nbits-large", dag, feeds, want, level_4_bounds(want), 4,
                 float_dag=str(float_dag.relative_to(folder)), max_ratio=NARROW_RATIO)


def _passed(report: str) -> set[str]:
    return set(re.findall(r"^ok \d+ - (.+)$", report, re.MULTILINE))


def _outputs_test(case) -> str:
    return (f"{json.loads(case.read_text())['name']}: onnxruntime's outputs within the accuracy level's bound, "
            "each CU holding the Python runtime's bytes")


def test_node_runs_matmul_nbits_at_levels_0_and_4_and_counts_its_narrow_bytes(tmp_path):
    cases = [nodes_case(tmp_path, 0, SIMD), nodes_case(tmp_path, 4, SIMD), large_case(tmp_path)]
    report = run_node_tests(cases, tmp_path, "nbits.test.js", "models.test.js")
    expected = {_outputs_test(c) for c in cases}
    expected.add("nbits-large: the 4-bit CU holds at most 0.2x the bytes of its float32 twin's")
    assert not expected - _passed(report), report[-3000:]


def test_node_runs_4_bit_level_4_under_relaxed_simd(tmp_path):
    """The kernel's relaxed dot product (4-bit codes are 7-bit, so every engine must agree; the
    kernel avoids i32x4.relaxed_dot_i8x16_i7x16_add_s, which Node 20's V8 computes wrong)."""
    case = nodes_case(tmp_path, 4, RELAXED)
    report = run_node_tests([case], tmp_path, "nbits.test.js", "models.test.js")
    assert _outputs_test(case) in _passed(report), report[-3000:]
