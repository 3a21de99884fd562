"""Stacked com.microsoft::DynamicQuantizeLSTM layers as a speaker-embedding model holds them (three
layers, int8 weights with signed nonzero zero points, one tensor as both initial_h and initial_c,
a bias, no sequence_lens; forward and bidirectional; hidden 768 and an odd size), and the same
through torch's nn.LSTM and `quantize_dynamic`, compiled through the CLI and checked with
`cortex verify --bisect` on wasm and cuda-sim: every CU agrees with onnxruntime on its own inputs
within one quantum (a uint8 step of its output's range, what onnxruntime's activation quantization
moves a value by), and the model's outputs reach cosine 0.9999 against onnxruntime's kernel."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from cli_helpers import run_cli
from cortex.commands import verify
from cortex.tools import exact_u8s8
from samples.quantized_lstm_models import stacked_quantized_lstm, torch_lstm_quantized

MIN_COSINE = 0.9999


def verify_report(model: onnx.ModelProto, feeds: dict, folder, device: str) -> dict:
    """decompose, build-dag, compile for `device`, then `cortex verify --bisect --json`."""
    onnx.save(model, folder / "model.onnx")
    np.savez(folder / "feeds.npz", **feeds)
    compile_argv = (["compile-wasm", "--cu-dir", folder / "cus", "--output", folder / "wasm", "--dag", folder / "dag.json"]
                    if device == "wasm" else
                    ["compile-cuda", "--cu-dir", folder / "cus", "--output", folder / "cuda", "--dag", folder / "dag.json"])
    for argv in (["decompose", "--model-path", folder / "model.onnx", "--output-dir", folder / "cus"],
                 ["build-dag", "--cu-dir", folder / "cus", "--output", folder / "dag.json"], compile_argv):
        code, _, err = run_cli(argv)
        assert code == 0, f"{argv[0]}: {err}"
    # exit code 1: outside verify's float tolerance, which the activation quantization alone exceeds
    code, out, err = run_cli(["verify", folder / "dag.json", "--model", folder / "model.onnx", "--input",
                              folder / "feeds.npz", "--device", device, "--bisect", "--json"])
    assert code in (0, 1), err
    return json.loads(out)


def assert_matches_onnxruntime(report: dict, expected_outputs: set[str]) -> None:
    assert {o["name"] for o in report["outputs"]} == expected_outputs
    for output in report["outputs"]:
        assert output["cosine"] >= MIN_COSINE, output
    cus = report["bisect"]["cus"]
    assert cus and report["bisect"]["first_divergent_cu"] is None, report["bisect"]["summary"]
    for cu in cus:
        assert cu["compared"], cu
        for output in cu["outputs"]:
            # one uint8 step of a unit-sized activation range is 2/255; a float CU is far inside it
            assert output["max_abs_error"] <= 2.0 / 255, (cu["cu"], output)
            assert output["cosine"] >= MIN_COSINE, (cu["cu"], output)


CASES = {
    "forward-odd-hidden": dict(hidden=37, input_size=20, direction="forward", seq=5, batch=1),
    "bidirectional-odd-hidden": dict(hidden=37, input_size=20, direction="bidirectional", seq=4, batch=2),
    "per-channel-scales": dict(hidden=37, input_size=20, direction="bidirectional", seq=4, batch=1,
                               per_channel=True),
}


# cuda-sim compiles take three times wasm's: the case that holds every attribute runs on both
DEVICE_CASES = [(case, "wasm") for case in sorted(CASES)] + [("bidirectional-odd-hidden", "cuda-sim")]


@pytest.mark.parametrize("case,device", DEVICE_CASES)
def test_stacked_quantized_lstm_matches_onnxruntime(case, device, tmp_path):
    model, feeds = stacked_quantized_lstm(layers=3, **CASES[case])
    assert sum(n.op_type == "DynamicQuantizeLSTM" for n in model.graph.node) == 3
    assert_matches_onnxruntime(verify_report(model, feeds, tmp_path, device), {"y", "y_h"})


@pytest.mark.parametrize("device", ["wasm", "cuda-sim"])
def test_a_loud_frame_is_quantized_as_onnxruntime_quantizes_it(device, tmp_path):
    """onnxruntime quantizes the whole sequence X with one uint8 scale, so one loud frame coarsens
    every other frame's codes: a float LSTM over the dequantized weights alone stays at cosine
    0.9988 here; quantizing X as the kernel does brings it back past 0.9999."""
    model, feeds = stacked_quantized_lstm(hidden=37, input_size=20, layers=3, seq=30)
    feeds["x"][0, 0, 0] = 200.0
    assert_matches_onnxruntime(verify_report(model, feeds, tmp_path, device), {"y", "y_h"})


@pytest.mark.parametrize("direction,device", [("forward", "wasm"), ("bidirectional", "wasm")] + [
    pytest.param(direction, "cuda-sim", marks=pytest.mark.slow) for direction in ("forward", "bidirectional")])
def test_hidden_768_quantized_lstm_matches_onnxruntime(direction, device, tmp_path):
    """The user's size: each layer's recurrence is a CU of its own (over --max-cu-size). 12 to 17 s
    on wasm; cuda-sim's compiles take 30 to 60 s, so those run with the slow tests."""
    model, feeds = stacked_quantized_lstm(hidden=768, input_size=80, layers=3, direction=direction, seq=3, batch=1)
    assert_matches_onnxruntime(verify_report(model, feeds, tmp_path, device), {"y", "y_h"})


@pytest.mark.parametrize("bidirectional", [False, True])
def test_torch_lstm_through_quantize_dynamic_matches_onnxruntime(bidirectional, tmp_path):
    model, feeds = torch_lstm_quantized(hidden=37, input_size=20, layers=3, bidirectional=bidirectional, seq=5)
    quantized = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLSTM"]
    assert len(quantized) == 3
    weights = {t.name: t for t in model.graph.initializer}
    assert weights[quantized[0].input[1]].data_type == onnx.TensorProto.INT8
    assert_matches_onnxruntime(verify_report(model, feeds, tmp_path, "wasm"), {"y", "y_h", "y_c"})


def _uint8_codes(x: np.ndarray) -> tuple[np.ndarray, float, int]:
    """onnxruntime's GetQuantizationParameter and MlasQuantizeLinear: range widened to hold 0."""
    lo, hi = min(0.0, float(x.min())), max(0.0, float(x.max()))
    scale = np.float32((hi - lo) / 255 if hi > lo else 1.0)
    zero = int(np.clip(np.rint(-lo / scale), 0, 255))
    return np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.int64), scale, zero


def _u8s8_product(a, a_zero, b, b_zero, saturate: bool) -> np.ndarray:
    """sum_k (a - a_zero)(b - b_zero) as MLAS computes it: raw products, each pair summed at int16
    with saturation where `saturate` (pmaddubsw), then the zero points' corrections."""
    if saturate:
        a, b = np.pad(a, ((0, 0), (0, a.shape[1] % 2))), np.pad(b, ((0, b.shape[0] % 2), (0, 0)))
        raw = np.clip(a[:, 0::2, None] * b[None, 0::2] + a[:, 1::2, None] * b[None, 1::2], -32768, 32767).sum(axis=1)
    else:
        raw = a @ b
    return raw - b_zero * a.sum(axis=1, keepdims=True) - a_zero * b.sum(axis=0, keepdims=True) \
        + a.shape[1] * a_zero * b_zero


def _kernel_model(model: onnx.ModelProto, feeds: dict, saturate: bool) -> np.ndarray:
    """The stacked forward layers of `stacked_quantized_lstm` as onnxruntime's DynamicQuantizeLSTM
    computes them: X quantized once per sequence, h once per step, integer products, gates i o f c."""
    init = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    y, state = feeds["x"], feeds["state"][0]
    for node in (n for n in model.graph.node if n.op_type == "DynamicQuantizeLSTM"):
        w, r = (init[node.input[i]][0].astype(np.int64) for i in (1, 2))
        bias = init[node.input[3]][0]
        w_scale, w_zero, r_scale, r_zero = (init[node.input[i]][0] for i in (8, 9, 10, 11))
        codes, x_scale, x_zero = _uint8_codes(y.reshape(-1, y.shape[-1]))
        gates_x = (_u8s8_product(codes, x_zero, w, int(w_zero), saturate) * (x_scale * w_scale)).astype(np.float32)
        gates_x = gates_x.reshape(*y.shape[:2], -1) + (bias[: w.shape[1]] + bias[w.shape[1]:]).astype(np.float32)
        h, c, steps = state, state, []
        for t in range(y.shape[0]):
            codes, h_scale, h_zero = _uint8_codes(h)
            gates = gates_x[t] + _u8s8_product(codes, h_zero, r, int(r_zero), saturate) * (h_scale * r_scale)
            i, o, f, g = np.split(gates.astype(np.float32), 4, axis=1)
            c = c / (1 + np.exp(-f)) + np.tanh(g) / (1 + np.exp(-i))
            h = np.tanh(c) / (1 + np.exp(-o))
            steps.append(h)
        y = np.stack(steps)
    return y


def test_verify_reference_of_dynamic_quantize_lstm_is_the_exact_kernel_where_onnxruntime_saturates(tmp_path, monkeypatch):
    """On x86 without VNNI onnxruntime's DynamicQuantizeLSTM sums u8 x s8 pairs at int16 with
    saturation; with int8 codes over the whole range (torch's initial weights quantized
    asymmetrically), three hidden-768 layers over 200 frames, this model of the kernel puts the last
    step's output at cosine 0.95 (log-mel input) or 0.83 (dB input) against the exact kernel.
    `cortex verify`'s reference then runs exact_u8s8's rewrite (uint8 weights): forced here, it
    must be the exact kernel (which onnxruntime is on a VNNI machine), not the saturating one."""
    model, feeds = stacked_quantized_lstm(hidden=37, input_size=20, layers=3, seq=6)
    feeds["x"] = 3 * np.abs(feeds["x"])       # a wide, one-sided X: high uint8 codes, pairs past int16
    onnx.save(model, tmp_path / "model.onnx")
    exact, saturated = _kernel_model(model, feeds, False), _kernel_model(model, feeds, True)
    assert np.abs(exact - saturated).max() > 0.01
    monkeypatch.setattr(exact_u8s8, "onnxruntime_saturates_u8s8", lambda: True)
    got, rewritten = verify._run_onnxruntime(tmp_path / "model.onnx", feeds, ["y"])
    assert rewritten
    assert np.abs(got["y"].reshape(exact.shape) - exact).max() < 1e-4
