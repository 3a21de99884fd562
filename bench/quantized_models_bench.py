"""Cortex (WebAssembly under wasmtime, simd + relaxed-simd, opt-level 3) against onnxruntime (native
CPU, one thread, all graph optimisations) on the same files: each model family float, dynamically
quantized (ConvInteger / MatMulInteger + DynamicQuantizeLinear), QDQ per tensor and per channel
(fold-qdq makes QLinearConv / QLinearMatMul of them) and QOperator static, timed interleaved; the
report is the median CPU time per run in ms (bench/timing.py).

`python -m bench.quantized_models_bench [--rounds N] [--only SUBSTRING]` prints one line per model."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench import cortex_side
from bench.timing import InProcess, interleave, repeats_for
from samples.light_models import light_model
from samples.minilm import ensure_minilm, minilm_feed
from samples.qdq_models import qdq_minilm, qdq_squeezenet
from samples.quantized_models import quantized_light_model, quantized_minilm

ort.set_default_logger_severity(3)


def cases() -> list[tuple[str, Path, dict, dict, dict]]:
    """(name, model path, feed, input shapes, dims) of every model measured."""
    found = []
    for seq in (16, 128):
        feed, dims = minilm_feed(1, seq), {"batch": 1, "seq": seq}
        found += [(f"minilm-s{seq}-float", ensure_minilm(), feed, {}, dims),
                  (f"minilm-s{seq}-dynamic", quantized_minilm(static=False).path, feed, {}, dims),
                  (f"minilm-s{seq}-qdq-per-tensor", qdq_minilm(False, 1, seq).path, feed, {}, dims),
                  (f"minilm-s{seq}-qdq-per-channel", qdq_minilm(True, 1, seq).path, feed, {}, dims),
                  (f"minilm-s{seq}-qoperator", quantized_minilm(static=True).path, feed, {}, dims)]
    light = light_model("squeezenet")
    found.append(("squeezenet-float", light.path, dict(light.inputs), dict(light.input_shapes), {}))
    for static in (False, True):
        q = quantized_light_model("squeezenet", static)
        found.append((f"squeezenet-{'qoperator' if static else 'dynamic'}", q.path, q.feed, q.input_shapes, {}))
    for per_channel in (False, True):
        q = qdq_squeezenet(per_channel)
        found.append((f"squeezenet-qdq-{'per-channel' if per_channel else 'per-tensor'}", q.path, q.inputs,
                      q.input_shapes, {}))
    return found


def _onnxruntime(path: Path, feed: dict) -> InProcess:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return InProcess("onnxruntime", lambda: session.run(None, feed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    for name, path, feed, input_shapes, dims in cases():
        if args.only not in name:
            continue
        reference = _onnxruntime(path, feed)
        names = [o.name for o in ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_outputs()]
        want = dict(zip(names, reference.run()))
        with tempfile.TemporaryDirectory() as folder:
            try:   # quantized outputs may move by a quantum where onnxruntime rounds float sums
                built = cortex_side.build(path, input_shapes, dims, feed, want, Path(folder), rtol=1.0, atol=1.0)
            except cortex_side.NotAvailable as e:
                print(f"{name:32s} cortex n/a: {e}", flush=True)
                continue
            cortex = built.contestant
            cortex.name = "cortex"
            first = min(t for t, _ in cortex.time(1, 1))
            results = interleave([cortex, reference], args.rounds, repeats_for(first))
            got = built.loaded.run(feed)
            error = max(float(np.max(np.abs(np.asarray(got[k], np.float64) - np.asarray(want[k], np.float64))))
                        for k in want)
            print(f"{name:32s} cortex {results['cortex'].median * 1e3:8.2f} ms  onnxruntime "
                  f"{results['onnxruntime'].median * 1e3:8.2f} ms  (max |diff| {error:.3g}, "
                  f"compile {sum(built.stage_s.values()):.0f} s)", flush=True)


if __name__ == "__main__":
    main()
