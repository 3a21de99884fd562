"""`cortex bench` and the `make bench` report: real timings of a compiled model, a report that says
why a number is missing instead of inventing one, and a page section that leaves the rest alone."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench import report
from bench.model_bench import ModelResult
from bench.timing import InProcess, interleave
from cli_helpers import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def compiled_dag(tmp_path_factory):
    """A two-layer MLP, decomposed, turned into a DAG and compiled to WASM with the CLI."""
    folder = tmp_path_factory.mktemp("bench")
    rng = np.random.default_rng(0)
    w1, w2 = (numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
              for n, s in (("w1", (32, 64)), ("w2", (64, 8))))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w1, w2])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "mlp.onnx")
    for argv in (["decompose", "--model-path", str(folder / "mlp.onnx"), "--output-dir", str(folder / "cus"),
                  "--min-cu-size", "1"],
                 ["build-dag", "--cu-dir", str(folder / "cus"), "--output", str(folder / "dag.json")],
                 ["compile-wasm", "--cu-dir", str(folder / "cus"), "--output", str(folder / "wasm"),
                  "--dag", str(folder / "dag.json")]):
        code, _, err = run_cli(argv)
        assert code == 0, (argv, err)
    return folder / "dag.json"


def test_bench_reports_every_run_and_every_cu(compiled_dag):
    code, out, err = run_cli(["bench", str(compiled_dag), "--repeat", "4", "--warmup", "1", "--json"])
    assert code == 0, err
    result = json.loads(out)
    dag = json.loads(compiled_dag.read_text())
    assert result["runs"] == 4
    assert result["min_ms"] <= result["median_ms"] <= result["max_ms"]
    assert sorted(c["cu"] for c in result["cus"]) == sorted(cu["id"] for cu in dag["cus"])
    assert math.isclose(sum(c["share"] for c in result["cus"]), 1.0, rel_tol=1e-9)
    assert all(c["median_ms"] > 0 for c in result["cus"])
    assert [c["median_ms"] for c in result["cus"]] == sorted((c["median_ms"] for c in result["cus"]), reverse=True)


def test_bench_prints_a_table_by_default(compiled_dag):
    code, out, err = run_cli(["bench", str(compiled_dag), "--repeat", "2", "--warmup", "0"])
    assert code == 0, err
    assert "median" in out and "cu-0000" in out


@pytest.mark.parametrize("argv,fragment", [(["--repeat", "0"], "--repeat"), (["--warmup", "-1"], "--warmup"),
                                           (["--top", "-2"], "--top")])
def test_bench_refuses_bad_counts(compiled_dag, argv, fragment):
    assert_one_line_error(*run_cli(["bench", str(compiled_dag), *argv])[::2], fragment)


def test_bench_of_a_missing_dag_is_one_line(tmp_path):
    assert_one_line_error(*run_cli(["bench", str(tmp_path / "nope.json")])[::2], "nope.json")


def test_interleaving_gives_every_contestant_the_same_number_of_runs():
    calls = []
    contestants = [InProcess("a", lambda: calls.append("a")), InProcess("b", lambda: calls.append("b"))]
    timings = interleave(contestants, rounds=3, repeat=2, warmup=1)
    assert [len(t.seconds) for t in timings.values()] == [6, 6]
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3  # one warm-up each, then alternating rounds


def _result(name, cortex=None, web=None, native=None, why=None, arena=None, bound=None):
    r = ModelResult(name)
    for key, ms in (("cortex-wasm", cortex), ("ort-web", web), ("ort-cpu", native)):
        if ms is not None:
            r.timings[key] = interleave([InProcess(key, lambda: None)], 1, 1)[key]
            r.timings[key].seconds = [ms / 1e3]
    if why:
        r.errors["cortex-wasm"] = why
    if arena is not None:
        r.memory = {"arena_bytes": arena, "lower_bound": bound}
    return r


def test_report_marks_missing_cortex_numbers_with_the_reason():
    lines, summary = report.model_table([_result("resnet50", web=300.0, native=100.0, why="compile-wasm failed: X")])
    row = next(line for line in lines if line.startswith("| resnet50"))
    assert "n/a (compile-wasm failed: X)" in row and "| 300.0 |" in row and "| 3.00 |" in row
    assert summary["cortex/web"] is None and summary["web/ort"] == pytest.approx(3.0)


def test_report_ratios_are_geometric_means():
    results = [_result("a", cortex=10.0, web=20.0, native=5.0, arena=110, bound=100),
               _result("b", cortex=40.0, web=20.0, native=10.0, arena=100, bound=100)]
    _, summary = report.model_table(results)
    assert summary["cortex/web"] == pytest.approx(1.0)   # sqrt(0.5 * 2)
    assert summary["cortex/ort"] == pytest.approx(math.sqrt(2 * 4))
    assert summary["worst arena/bound"] == pytest.approx(1.1)


def test_report_section_replaces_only_itself(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nHand-written intro.\n\n<!-- other section -->\nkept\n")
    report.write_section(page, f"{report.BEGIN}\nfirst\n{report.END}\n")
    report.write_section(page, f"{report.BEGIN}\nsecond\n{report.END}\n")
    text = page.read_text()
    assert text.count(report.BEGIN) == 1 and "second" in text and "first" not in text
    assert "Hand-written intro." in text and "<!-- other section -->\nkept" in text


@pytest.mark.slow
def test_make_bench_script_reports_every_contestant_on_a_small_model(tmp_path):
    """The whole `make bench` script on one model: ORT and (when installed) ORT-Web numbers, and for
    Cortex either a number or the reason there is none, never a crash."""
    from bench import bench_models, threads_bench
    from bench.node_runner import ORTWEB_DIR

    page, raw = tmp_path / "benchmarks.md", tmp_path / "bench.json"
    assert bench_models.main(["--models", "squeezenet", "--rounds", "1", "--no-gemm", "--output", str(page),
                              "--threads-models", "squeezenet", "--json", str(raw)]) == 0
    (result,) = json.loads(raw.read_text())["models"]
    assert result["timings"]["ort-cpu"]["median_s"] > 0
    if (ORTWEB_DIR / "node_modules" / "onnxruntime-web").is_dir():
        assert result["timings"]["ort-web"]["median_s"] > 0
    assert "cortex-wasm" in result["timings"] or result["errors"]["cortex-wasm"]
    assert result["memory"]["arena_bytes"] <= 1.1 * result["memory"]["lower_bound"]
    assert report.BEGIN in page.read_text() and "| squeezenet |" in page.read_text()
    document = json.loads(raw.read_text())
    assert [t["model"] for t in document["threads"]] == ["squeezenet"]
    assert [d["section"] for d in document["peak_drift"]] == ["models", "threads"]
    assert threads_bench.BEGIN in page.read_text()
