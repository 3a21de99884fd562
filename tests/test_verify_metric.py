"""`cortex verify` reports each output's cosine similarity and top-1 agreement, gates on them with
`--metric`, and says when dynamic quantization, not a wrong CU, explains a difference.

The quantized model is a small transformer (4 encoder layers with GELU, a linear head) exported
from torch and quantized with onnxruntime's `quantize_dynamic`: its Erf, Softmax and LayerNorm
results differ from onnxruntime's in the last bit now and then, just before a DynamicQuantizeLinear,
which then flips a code; the logits move by about 1e-2 while every CU is right on its own inputs.
The wrong float model is the bisection tests' chain with one CU's module computing Sub for Add."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cli_helpers import assert_one_line_error, run_cli
from cortex.tools.accuracy import cosine_similarity, parse_metric_gate, top1_agreement
from cortex.tools.exact_u8s8 import reference_source
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from samples.contrib_models import cached_model, quantized_dynamic
from test_verify_bisect import chain_model, compile_chain, plant

WIDTH, LAYERS, CLASSES, SEQ = 64, 4, 16, 48


def transformer_onnx(folder: Path) -> Path:
    import torch

    torch.manual_seed(0)

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, activation="gelu", batch_first=True)
                for _ in range(LAYERS))
            self.head = torch.nn.Linear(WIDTH, CLASSES)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    path = folder / "float.onnx"
    torch.onnx.export(Tagger().eval(), (torch.zeros(2, SEQ, WIDTH),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["logits"])
    return path


def compile_cli(model: Path, folder: Path) -> Path:
    for argv in (["decompose", "--model-path", model, "--output-dir", folder / "cus"],
                 ["build-dag", "--cu-dir", folder / "cus", "--output", folder / "dag.json"],
                 ["compile-wasm", "--cu-dir", folder / "cus", "--dag", folder / "dag.json", "--output", folder / "wasm"]):
        code, _, err = run_cli(argv)
        assert code == 0, f"{argv[0]}: {err}"
    return folder / "dag.json"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(dag.json, int8 model, x.npy, Cortex's logits from `cortex run`, onnxruntime's)."""
    folder = tmp_path_factory.mktemp("int8")
    model = cached_model("verify-metric-tagger-int8", lambda d: quantized_dynamic(transformer_onnx(d), d),
                         prefix="dynamic")
    dag = compile_cli(model, folder)
    x = (np.random.default_rng(0).standard_normal((2, SEQ, WIDTH)) * 3).astype(np.float32)
    np.save(folder / "x.npy", x)
    code, _, err = run_cli(["run", dag, "--input", f"x={folder / 'x.npy'}", "--output", folder / "out.npz"])
    assert code == 0, err
    with np.load(folder / "out.npz") as got:
        ours = got["logits"]
    source, feeds, _ = reference_source(model, {"x": x})
    (theirs,) = ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(["logits"], feeds)
    return dag, model, folder / "x.npy", ours, theirs


def verify(dag, model, x, *extra) -> tuple[int, dict, str]:
    code, out, err = run_cli(["verify", dag, "--model", model, "--input", f"x={x}", "--json", *extra])
    return code, (json.loads(out) if out.strip() else {}), err


def test_cosine_and_top1_are_those_of_the_run_outputs(quantized):
    dag, model, x, ours, theirs = quantized
    code, report, err = verify(dag, model, x)
    (row,) = report["outputs"]
    # The quantized logits are outside the float tolerance: the case the metrics are for.
    assert code == 1 and not report["ok"] and not row["ok"] and 1e-3 < row["max_abs_error"] < 0.5, (row, err)
    a, b = ours.astype(np.float64).ravel(), theirs.astype(np.float64).ravel()
    cosine = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    top1 = np.mean(ours.argmax(-1) == theirs.argmax(-1))
    assert row["cosine"] == pytest.approx(cosine, abs=1e-12) and 0.999 < cosine < 1
    assert row["top1"] == pytest.approx(top1, abs=1e-12) and 0.9 < top1 <= 1
    assert row["max_abs_error"] == pytest.approx(np.abs(ours - theirs).max(), rel=1e-6)


def test_metric_gate_passes_below_what_is_achieved_and_fails_above(quantized):
    dag, model, x, _, _ = quantized
    _, report, _ = verify(dag, model, x)
    (row,) = report["outputs"]
    below = f"cosine:{row['cosine'] - 1e-6:.9f},top1:{row['top1'] - 1e-3:.6f}"
    code, passed, err = verify(dag, model, x, "--metric", below)
    assert code == 0 and passed["ok"] and not passed["within_tolerance"], err
    assert passed["metric"] == parse_metric_gate(below) and passed["outputs"][0]["below_metric"] == []
    above = f"cosine:{(1 + row['cosine']) / 2:.12f}"
    code, failed, err = verify(dag, model, x, "--metric", above)
    assert code == 1 and not failed["ok"], err
    assert failed["outputs"][0]["below_metric"][0].startswith("cosine ")
    if row["top1"] < 1:
        code, _, err = verify(dag, model, x, "--metric", "top1:1")
        assert code == 1, err


def test_the_report_says_quantization_explains_the_difference(quantized):
    dag, model, x, _, _ = quantized
    _, report, _ = verify(dag, model, x)
    cause = report["explanation"]
    assert cause["quantization"] and cause["wrong_cu"] is None, cause
    cus = {cu["id"]: cu for cu in json.loads(Path(dag).read_text())["cus"]}
    start = cus[cause["drift_start_cu"]]
    producers = {out: cu for cu in cus.values() for out in cu["outputs"]}
    reads_quantized = any(producers[t].get("quantizes") for t in start["inputs"] if t in producers)
    assert start.get("quantizes") or reads_quantized
    code, out, err = run_cli(["verify", dag, "--model", model, "--input", f"x={x}", "--metric", "cosine:0.999"],
                             env={"COLUMNS": "200"})
    assert code == 0, err
    assert "quantization explains the difference" in out and cause["drift_start_cu"] in out
    # With --bisect the explanation comes from that run, and agrees.
    code, bisected, _ = verify(dag, model, x, "--bisect")
    assert bisected["explanation"] == cause and bisected["bisect"]["drift_start_cu"] == cause["drift_start_cu"]


def int4_level_4(source: Path, folder: Path) -> Path:
    """MatMulNBitsQuantizer's 4-bit blocks of 32 at accuracy level 4 (A quantized per block to int8)."""
    quantizer = MatMulNBitsQuantizer(str(source), block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    path = folder / "int4.onnx"
    quantizer.model.save_model_to_file(str(path))
    return path


def test_matmul_nbits_at_accuracy_level_4_is_explained_as_quantization(tmp_path):
    """Its A is quantized per block at run time: a last-bit difference before it flips a code."""
    model = cached_model("verify-metric-tagger-int4-level4", lambda d: int4_level_4(transformer_onnx(d), d),
                         prefix="nbits")
    dag = compile_cli(model, tmp_path)
    x = tmp_path / "x.npy"
    np.save(x, (np.random.default_rng(0).standard_normal((2, SEQ, WIDTH)) * 3).astype(np.float32))
    code, report, err = verify(dag, model, x)
    assert any(cu.get("quantizes") for cu in json.loads(Path(dag).read_text())["cus"])
    if code == 0:   # no code flipped on this machine: nothing to explain
        return
    cause = report["explanation"]
    assert cause["quantization"] and cause["wrong_cu"] is None, cause


def test_a_float_model_with_a_wrong_cu_is_not_explained_by_quantization(tmp_path):
    good = compile_chain(tmp_path / "good", chain_model())
    wrong = compile_chain(tmp_path / "wrong", chain_model(ops={2: "Sub"}))
    plant(good, wrong, ["cu-0002"])
    model = tmp_path / "good" / "model.onnx"
    code, out, err = run_cli(["verify", good, "--model", model, "--json"])
    assert code == 1, err
    cause = json.loads(out)["explanation"]
    assert not cause["quantization"] and cause["wrong_cu"] == "cu-0002" and cause["drift_start_cu"] == "cu-0002"
    code, out, _ = run_cli(["verify", good, "--model", model, "--metric", "cosine:0.9999"], env={"COLUMNS": "200"})
    assert code == 1 and "not quantization" in out and "quantization explains" not in out
    assert "cu-0002" in out


def test_a_float_model_outside_a_too_tight_tolerance_is_not_explained_by_quantization(tmp_path):
    """The same transformer unquantized, with a zero tolerance: its last-bit differences are float
    rounding, which the report must not put on quantization."""
    model = cached_model("verify-metric-tagger-float", transformer_onnx, prefix="dynamic")
    dag = compile_cli(model, tmp_path)
    x = (np.random.default_rng(0).standard_normal((2, SEQ, WIDTH)) * 3).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code, report, err = verify(dag, model, tmp_path / "x.npy", "--rtol", "0", "--atol", "0", "--metric",
                               "cosine:0.99999,top1:1")
    assert code == 0 and report["ok"] and not report["within_tolerance"], err
    assert not report["explanation"]["quantization"], report["explanation"]


@pytest.mark.parametrize("metric,fragment", [("cosine", "'cosine' is not NAME:MIN"),
                                             ("cosine:high", "cosine's minimum 'high' is not a number"),
                                             ("top1:1.5", "top1's minimum 1.5 is outside [0, 1]"),
                                             ("cosine:0.9,cosine:0.99", "cosine given twice"),
                                             ("l2:0.1", "'l2:0.1' is not NAME:MIN"),
                                             ("top1:nan", "outside")])
def test_a_malformed_metric_is_one_line_exit_2(metric, fragment, tmp_path):
    code, _, err = run_cli(["verify", tmp_path / "dag.json", "--model", tmp_path / "m.onnx", "--metric", metric])
    assert_one_line_error(code, err, f"--metric {metric}", fragment)


def test_metric_values_at_their_edges():
    assert cosine_similarity(np.zeros(3), np.zeros(3)) == 1.0
    assert cosine_similarity(np.zeros(3), np.ones(3)) == 0.0
    assert cosine_similarity(np.array([1.0, -np.inf]), np.array([2.0, -np.inf])) == pytest.approx(1.0)
    assert cosine_similarity(-np.ones(4), np.ones(4)) == pytest.approx(-1.0)
    assert top1_agreement(np.float32(1), np.float32(1)) is None
    assert top1_agreement(np.ones((3, 1)), np.ones((3, 1))) is None
    scores = np.array([[0.1, 0.9], [0.8, 0.2]])
    assert top1_agreement(scores, scores[:, ::-1].copy()) == 0.0
    assert top1_agreement(scores, np.array([[0.0, 1.0], [0.0, 1.0]])) == 0.5
    assert parse_metric_gate("cosine:0.999, top1:0.95") == {"cosine": 0.999, "top1": 0.95}
