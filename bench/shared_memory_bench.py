"""`make bench-shared-memory`: one shared linear memory per model against per-CU memories, measured.

Each model is built twice as `make bench` builds it (decompose, build-dag, compile-wasm with
simd,relaxed-simd at -O3), once with `--memory per-cu` (the default) and once with `--memory shared`,
and both builds run in one process under the strict policy (every CU, every run, one thread).
Contestants are interleaved round after round (bench/timing.py); the figures are the median CPU
time of each, the ratio shared / per-cu with the spread of the per-round ratios (min..max), the
bytes copied between CUs per inference (`sandbox_stats.bytes_copied_between_cus` of the trace), the
memory the CUs hold and a warm load's time. Outputs are checked against the model's reference and
against each other (bitwise) before anything is timed. The FMA-loop peak is measured before and after
each model: a drift past 10% says the machine was busy and the figures are noisy.

    python -m bench.shared_memory_bench [--models densenet121,minilm-l6-s128] [--rounds 7] [--json out/x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import cortex
from bench import machine
from bench.model_bench import MINILM, model_case
from bench.threads_bench import Drift, fma_peak
from bench.timing import InProcess, interleave, repeats_for
from ir.fs import write_bytes_atomically

DEFAULT_MODELS = ("densenet121", MINILM)
MEMORIES = ("per-cu", "shared")
MB = 1 << 20


def _cortex(*argv) -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "cortex"), *map(str, argv)], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"cortex {argv[0]} failed: {(done.stderr.strip().splitlines() or ['no message'])[-1]}")


def build(case, memory: str, out: Path) -> tuple[Path, float]:
    """dag.json of `case` compiled with `--memory memory`, and the compile-wasm seconds."""
    bind = [f"--input-shape={name}={'x'.join(map(str, shape))}" for name, shape in case.input_shapes.items()]
    bind += [f"--dim={name}={value}" for name, value in case.dims.items()]
    _cortex("decompose", "--model-path", case.path, "--output-dir", out / "cus", *bind)
    _cortex("build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json")
    start = time.perf_counter()
    _cortex("compile-wasm", "--cu-dir", out / "cus", "--output", out / "wasm-bin", "--dag", out / "dag.json",
            "--features", "simd,relaxed-simd", "--opt-level", "3", "--memory", memory)
    return out / "dag.json", time.perf_counter() - start


def _check(case, outputs: dict) -> float:
    worst = 0.0
    for name, want in case_reference(case).items():
        got = np.asarray(outputs[name])
        if got.shape != np.shape(want) or not np.allclose(got, want, rtol=1e-3, atol=1e-4):
            raise RuntimeError(f"{case.name}: output {name!r} differs from the reference")
        worst = max(worst, float(np.max(np.abs(got - want))) if got.size else 0.0)
    return worst


def case_reference(case) -> dict:
    import onnxruntime as ort
    session = ort.InferenceSession(str(case.path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, case.feeds)))


def measure(name: str, rounds: int, workdir: Path, log=print) -> dict:
    case = model_case(name)
    before = fma_peak()
    dags, compile_s, loaded, load_s = {}, {}, {}, {}
    for memory in MEMORIES:
        dags[memory], compile_s[memory] = build(case, memory, workdir / name / memory)
        cortex.load(dags[memory], policy="strict", threads=1).run(case.feeds)    # cold files, engine set-up
        start = time.perf_counter()
        loaded[memory] = cortex.load(dags[memory], policy="strict", threads=1)
        loaded[memory].run(case.feeds)      # cortex.load is lazy: the first run loads every CU
        load_s[memory] = time.perf_counter() - start
    outputs = {memory: model.run(case.feeds) for memory, model in loaded.items()}
    error = max(_check(case, outputs[memory]) for memory in MEMORIES)
    identical = all(np.array_equal(outputs["shared"][k], outputs["per-cu"][k]) for k in outputs["shared"])
    stats = {memory: dict(model.last_trace["sandbox_stats"]) for memory, model in loaded.items()}
    resident = {memory: model.scheduler.resident_bytes() for memory, model in loaded.items()}
    probe = InProcess("probe", lambda: loaded["per-cu"].run(case.feeds)).time(1, 2)
    repeat = repeats_for(min(cpu for _, cpu in probe), budget=1.0, most=10)
    # One round at a time, so each round's ratio is of runs made minutes apart at most.
    per_round: dict[str, list[float]] = {memory: [] for memory in MEMORIES}
    timings = {memory: [] for memory in MEMORIES}
    walls = {memory: [] for memory in MEMORIES}
    for _ in range(rounds):
        got = interleave([InProcess(memory, lambda m=memory: loaded[m].run(case.feeds)) for memory in MEMORIES],
                         1, repeat, warmup=0)
        for memory in MEMORIES:
            per_round[memory].append(got[memory].median)
            timings[memory] += got[memory].seconds
            walls[memory] += got[memory].wall_seconds
    ratios = [s / p for s, p in zip(per_round["shared"], per_round["per-cu"])]
    rebuild = rebuild_ms(loaded)
    drift = Drift(name, before, fma_peak())
    result = {
        "model": name, "cus": len(loaded["shared"].dag["cus"]), "runs_each": len(timings["shared"]),
        "max_abs_error": error, "bitwise_identical": identical,
        "median_ms": {m: statistics.median(timings[m]) * 1e3 for m in MEMORIES},
        "min_ms": {m: min(timings[m]) * 1e3 for m in MEMORIES},
        "wall_median_ms": {m: statistics.median(walls[m]) * 1e3 for m in MEMORIES},
        "ratio_shared_over_per_cu": statistics.median(timings["shared"]) / statistics.median(timings["per-cu"]),
        "round_ratios": ratios,
        "bytes_copied_between_cus": {m: stats[m]["bytes_copied_between_cus"] for m in MEMORIES},
        "resident_mb": {m: resident[m] / MB for m in MEMORIES},
        "warm_load_s": load_s, "compile_wasm_s": compile_s, "rebuild_after_trap_ms": rebuild,
        "drift": drift.to_json(),
    }
    log(f"  {name}: {drift.note()}")
    return result


def rebuild_ms(loaded: dict) -> dict:
    """What the sandbox's rebuild after a trap costs: per-cu rebuilds the failed CU's store (the
    median and the largest over the CUs), shared rebuilds the whole model's (median of 3)."""
    per_cu = loaded["per-cu"].scheduler.devices["wasm"]
    each = []
    for cu_id in loaded["per-cu"].dag["order"]:
        start = time.perf_counter()
        per_cu._rebuild(loaded["per-cu"].scheduler.cus[cu_id])
        each.append((time.perf_counter() - start) * 1e3)
    shared = loaded["shared"].scheduler.devices["wasm"]
    whole = []
    for _ in range(3):
        start = time.perf_counter()
        shared._rebuild_model()
        whole.append((time.perf_counter() - start) * 1e3)
    return {"per-cu median": statistics.median(each), "per-cu largest": max(each), "shared": statistics.median(whole)}


def report(results: list[dict]) -> str:
    header = ("| model | CUs | per-cu ms | shared ms | shared / per-cu (rounds min..max) | copied between CUs "
              "per inference, per-cu -> shared | resident MB per-cu / shared | warm load s per-cu / shared |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | n/a: {r['error']} |||||||")
            continue
        copied = r["bytes_copied_between_cus"]
        lines.append(
            f"| {r['model']} | {r['cus']} | {r['median_ms']['per-cu']:.2f} | {r['median_ms']['shared']:.2f} | "
            f"{r['ratio_shared_over_per_cu']:.3f} ({min(r['round_ratios']):.3f}..{max(r['round_ratios']):.3f}) | "
            f"{copied['per-cu'] / 1e6:.1f} MB -> {copied['shared'] / 1e6:.1f} MB | "
            f"{r['resident_mb']['per-cu']:.1f} / {r['resident_mb']['shared']:.1f} | "
            f"{r['warm_load_s']['per-cu']:.2f} / {r['warm_load_s']['shared']:.2f} |")
    notes = [f"- {r['model']}: {Drift(r['model'], r['drift']['before_gflops'], r['drift']['after_gflops']).note()}; "
             f"{r['runs_each']} runs each, outputs {'bitwise identical' if r['bitwise_identical'] else 'DIFFER'}; "
             f"rebuild after a trap: per-cu {r['rebuild_after_trap_ms']['per-cu median']:.1f} ms median, "
             f"{r['rebuild_after_trap_ms']['per-cu largest']:.1f} ms largest CU; shared "
             f"{r['rebuild_after_trap_ms']['shared']:.1f} ms (the whole model)"
             for r in results if "error" not in r]
    return "\n".join([*lines, "", *notes])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    host = {"cpu": machine.cpu_model(), "load_average": round(os.getloadavg()[0], 2)}
    print(f"shared memory against per-CU memories on {host['cpu']}, load average {host['load_average']}")
    results = []
    with tempfile.TemporaryDirectory(prefix="cortex-shared-memory-") as tmp:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            try:
                results.append(measure(name, args.rounds, Path(tmp)))
            except RuntimeError as e:
                results.append({"model": name, "error": str(e)})
    print(report(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(args.json, (json.dumps({"machine": host, "results": results}, indent=2) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
