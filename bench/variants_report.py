"""Reduced-precision variants on a real model: artifact bytes per precision, calibrated trust,
end-to-end agreement on held-back feeds and latency under each policy (wasm device).

`python -m bench.variants_report minilm|squeezenet|resnet50|... [--calibration 8] [--held-back 4]
[--out DIR]` decomposes the model, compiles it with `--variants fp16,bf16,int8`, calibrates on
`--calibration` feeds and evaluates on `--held-back` other feeds (never seen by calibrate): for each
policy, the worst relative L2 error of the model's output against the exact (strict) run and
against onnxruntime, the top-1 agreement for classifiers, and the median latency of a run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort

import cortex
from backends.registry import target
from backends.wasm.options import parse_options
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from cortex.tools.calibrate import calibrate, relative_l2
from ir.fs import write_bytes_atomically
from passes.partition import PartitionIntoCUs
from samples.light_models import light_model
from samples.minilm import ensure_minilm
from samples.qdq_models import _with_random_weights

PRECISIONS = ("fp16", "bf16", "int8")


def minilm_feeds(count: int, seed: int, seq: int = 16) -> list[dict]:
    """Sentence-like token ids ([CLS] ... [SEP], padded tail masked), a different length each."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(count):
        ids = rng.integers(1000, 30000, size=(1, seq), dtype=np.int64)
        used = int(rng.integers(4, seq + 1))
        mask = np.zeros((1, seq), dtype=np.int64)
        mask[:, :used] = 1
        ids[:, 0], ids[:, used - 1], ids[:, used:] = 101, 102, 0
        feeds.append({"input_ids": ids, "attention_mask": mask})
    return feeds


def image_feeds(name: str, shape: tuple, count: int, seed: int) -> list[dict]:
    """Smooth random images in [0, 1) (the stored reference input is arange(n) / n)."""
    rng = np.random.default_rng(seed)
    return [{name: rng.random(shape, dtype=np.float32)} for _ in range(count)]


def prepare(model: str, calibration: int, held_back: int, out: Path):
    """The model file, its shapes and dims, and calibration and held-back feeds. The light models'
    weights are constant fills (every value of a tensor equal: int8 stores them exactly), so they
    get the random He-scaled weights samples/qdq_models.py gives them, for errors worth measuring."""
    if model == "minilm":
        path, shapes, dims = ensure_minilm(), {"input_ids": (1, 16), "attention_mask": (1, 16)}, {"batch": 1, "seq": 16}
        return path, shapes, dims, minilm_feeds(calibration, 1), minilm_feeds(held_back, 2)
    case = light_model(model)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{model}-random-weights.onnx"
    onnx.save(_identity_batch_norms(_with_random_weights(onnx.load(case.path))), path)
    ((name, shape),) = case.input_shapes.items()
    return path, case.input_shapes, {}, image_feeds(name, shape, calibration, 1), image_feeds(name, shape, held_back, 2)


def _identity_batch_norms(model: onnx.ModelProto) -> onnx.ModelProto:
    """Random BatchNormalization statistics can be negative variances (NaN everywhere after):
    each BN gets scale 1, bias 0, mean 0 and variance 1, so the He-scaled convolutions set the scale."""
    inits = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            for name, value in zip(node.input[1:5], (1.0, 0.0, 0.0, 1.0)):
                if name in inits:
                    array = onnx.numpy_helper.to_array(inits[name])
                    inits[name].CopyFrom(onnx.numpy_helper.from_array(np.full_like(array, value), name))
    return model


def median_seconds(model, feed: dict, policy: str, rounds: int) -> float:
    model.run(feed, policy=policy)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model.run(feed, policy=policy)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def report(model_name: str, out: Path, calibration: int, held_back: int, rounds: int) -> dict:
    path, shapes, dims, cal_feeds, test_feeds = prepare(model_name, calibration, held_back, out)
    out.mkdir(parents=True, exist_ok=True)
    limits = PartitionIntoCUs(min_cu_size=4096, max_cu_size=4_000_000, max_cu_depth=8)
    decompose_model(Path(path), out / "cus", limits, input_shapes=shapes, dims=dims)
    dag_path = out / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out / "cus", dag_path), indent=2).encode())
    compiled = compile_cu_dir(target("wasm"), out / "cus", out / "wasm-bin", parse_options(None, "simd", "2"),
                              dag_path, variants=PRECISIONS)
    np.savez(out / "calibration.npz", **{k: np.stack([f[k] for f in cal_feeds]) for k in cal_feeds[0]})
    start = time.perf_counter()
    calibrate(dag_path, out / "calibration.npz")
    calibrate_seconds = time.perf_counter() - start
    dag = json.loads(dag_path.read_text())
    trusts = {p: sorted(cu["variants"][p]["trust"] for cu in dag["cus"] if p in cu.get("variants", {}))
              for p in PRECISIONS}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    # No result cache: the same feed runs again and again for the latency, which must time the CUs.
    model = cortex.load(dag_path, policy="strict", cache_bytes=0, threads=1)
    result = {"model": model_name, "cus": len(dag["cus"]), "cus_with_variants": sum(1 for c in dag["cus"] if c.get("variants")),
              "bytes": {"float32": compiled["bytes"], **compiled["variant_bytes"]},
              "trust": {p: {"min": min(t), "median": float(np.median(t)), "max": max(t)} for p, t in trusts.items() if t},
              "calibrate_seconds": round(calibrate_seconds, 1), "policies": {}}
    output = dag["outputs"][0]["name"]
    for policy in ("strict", "balanced", "aggressive"):
        worst_exact = worst_ort = 0.0
        top1 = 0
        approximated = fell_back = 0
        for feed in test_feeds:
            exact = model.run(feed, policy="strict")[output]
            got = model.run(feed, policy=policy)[output]
            trace = model.trace_document()
            approximated += len(trace["approximated_cus"])
            fell_back += len(trace["fell_back_cus"])
            (reference,) = session.run(None, feed)
            worst_exact = max(worst_exact, relative_l2(got, exact))
            worst_ort = max(worst_ort, relative_l2(got, reference))
            top1 += int(np.argmax(got.reshape(got.shape[0], -1)[0]) == np.argmax(reference.reshape(reference.shape[0], -1)[0]))
        result["policies"][policy] = {
            "worst_relative_l2_vs_exact": worst_exact, "worst_relative_l2_vs_onnxruntime": worst_ort,
            "top1_agreement": f"{top1}/{len(test_feeds)}" if model_name != "minilm" else None,
            "approximated_cus_per_run": approximated / len(test_feeds), "fell_back_cus_per_run": fell_back / len(test_feeds),
            "median_ms": round(median_seconds(model, test_feeds[0], policy, rounds) * 1e3, 2)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--calibration", type=int, default=8)
    parser.add_argument("--held-back", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(f"/tmp/cortex-variants-{args.model}")
    print(json.dumps(report(args.model, out, args.calibration, args.held_back, args.rounds), indent=2))


if __name__ == "__main__":
    main()
