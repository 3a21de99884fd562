"""Memory tiers, measured: VGG under a memory budget of a quarter of its weights against the same
model with every CU resident (`make bench-runtime`; figures, never test assertions).

The model is samples/vgg.py's (vgg19 by default: 548 MB of random float32 weights), decomposed
with `--max-cu-size` so that its largest CU fits the budget with room to prefetch the next one
(the first fully connected layer alone holds 103 M parameters and is split along its outputs),
compiled for wasm. Each measurement is a fresh process (`measure`, below), so its peak RSS
(VmHWM, `process_maxrss_mb`: getrusage's ru_maxrss would carry the parent's peak over) is its own: first every CU resident, then under the budget, interleaved over rounds,
after one unmeasured process that fills the native-code cache, so that every measured load is warm
(compiling a CU to native code takes more memory than running it). Reported:
- the runtime's own baseline: the RSS of a process that loaded the model under the budget, before
  its first request (no CU resident yet: the interpreter, the libraries, dag.json, the engine);
- peak RSS under the budget against budget + baseline + 10%;
- latency (wall-clock median of the timed runs, median over rounds) under the budget over the
  unconstrained one, against 1.3;
- the trace's byte counts per request: loaded, evicted, wasted (0 expected: VGG has no
  conditional CU and the policy is strict, so nothing is skipped), prefetch hits and misses.

    python -m bench.memory_tiers_bench [--width 1.0] [--rounds 3] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cortex.runtime.trace import process_maxrss_mb, process_rss_mb
from samples.cache import CACHE_DIR
from samples.vgg import ensure_vgg, vgg_input, vgg_name

MB = 1 << 20
BUDGET_SHARE = 0.25
RSS_MARGIN = 0.10
TARGET_LATENCY_RATIO = 1.3
# Parameters per CU: a quarter of vgg19's weights is 137 MB; CUs of at most 64 MB of weights leave
# room for the next one to load while one runs. Scaled with the width for smaller VGGs.
MAX_CU_PARAMS = 16_000_000


def _cortex(*argv) -> None:
    subprocess.run([str(Path(sys.executable).parent / "cortex"), *map(str, argv)], check=True,
                   capture_output=True, text=True)


def build(width: float, out: Path) -> tuple[Path, int]:
    """The compiled VGG (kept under .cache/ between runs) and the --max-cu-size it was cut with."""
    model = ensure_vgg("E", width)
    max_cu_size = max(1, int(MAX_CU_PARAMS * width * width))
    dag_path = out / "dag.json"
    stamp = out / "built-with.json"
    wanted = {"model": model.name, "size": model.stat().st_size, "max_cu_size": max_cu_size}
    if dag_path.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return dag_path, max_cu_size
    _cortex("decompose", "--model-path", model, "--output-dir", out / "cus", "--max-cu-size", max_cu_size)
    _cortex("build-dag", "--cu-dir", out / "cus", "--output", dag_path)
    _cortex("compile-wasm", "--cu-dir", out / "cus", "--dag", dag_path, "--output", out / "wasm-bin",
            "--features", "simd,relaxed-simd", "--opt-level", "3")
    stamp.write_text(json.dumps(wanted))
    return dag_path, max_cu_size


def measure(dag_path: Path, budget_mb: float | None, runs: int, warmup: int) -> dict:
    """One process's figures (run by `_measure_in_child` in a fresh interpreter)."""
    import cortex

    model = cortex.load(dag_path, policy="strict", memory_budget_mb=budget_mb)
    baseline = process_rss_mb()
    feeds = vgg_input()
    for _ in range(warmup):
        model.run(feeds)
    seconds, memories = [], []
    for _ in range(runs):
        start = time.perf_counter()
        model.run(feeds)
        seconds.append(time.perf_counter() - start)
        memories.append(model.last_trace["memory"])
    return {"budget_mb": budget_mb, "baseline_rss_mb": baseline, "peak_rss_mb": process_maxrss_mb(), "median_ms": statistics.median(seconds) * 1e3,
        "min_ms": min(seconds) * 1e3,
        "per_request": {key: statistics.median(m[key] for m in memories) for key in
                        ("bytes_loaded", "bytes_evicted", "wasted_bytes", "prefetch_hits", "prefetch_misses",
                         "already_resident", "peak_resident_bytes")}}


def _measure_in_child(dag_path: Path, budget_mb: float | None, runs: int, warmup: int) -> dict:
    argv = [sys.executable, "-m", "bench.memory_tiers_bench", "--measure", str(dag_path), "--runs", str(runs),
            "--warmup", str(warmup)] + ([] if budget_mb is None else ["--budget-mb", str(budget_mb)])
    result = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(result.stdout)


def report(width: float = 1.0, rounds: int = 3, runs: int = 3, warmup: int = 1) -> dict:
    out = CACHE_DIR / "bench-memory-tiers" / vgg_name("E", width)
    dag_path, max_cu_size = build(width, out)
    dag = json.loads(dag_path.read_text())
    weights = sum(cu["artifacts"]["wasm"]["memory"]["weights_bytes"] for cu in dag["cus"])
    largest = max(cu["artifacts"]["wasm"]["memory"]["memory_bytes"] for cu in dag["cus"])
    budget_mb = round(BUDGET_SHARE * weights / MB, 1)
    _measure_in_child(dag_path, None, 1, 0)     # fills the native-code cache: every measured load is warm
    unconstrained, budgeted = [], []
    for _ in range(rounds):
        unconstrained.append(_measure_in_child(dag_path, None, runs, warmup))
        budgeted.append(_measure_in_child(dag_path, budget_mb, runs, warmup))
    baseline = statistics.median(m["baseline_rss_mb"] for m in budgeted)
    peak = max(m["peak_rss_mb"] for m in budgeted)
    latency = {"unconstrained": statistics.median(m["median_ms"] for m in unconstrained),
               "budget": statistics.median(m["median_ms"] for m in budgeted)}
    rss_limit = (budget_mb + baseline) * (1 + RSS_MARGIN)
    return {"model": vgg_name("E", width), "width": width, "cus": len(dag["cus"]), "max_cu_size": max_cu_size,
            "weights_mb": weights / MB, "largest_cu_mb": largest / MB, "budget_mb": budget_mb,
            "baseline_rss_mb": baseline, "peak_rss_mb": peak,
            "peak_rss_unconstrained_mb": max(m["peak_rss_mb"] for m in unconstrained),
            "rss_limit_mb": rss_limit, "rss_goal_met": peak <= rss_limit,
            "median_ms": latency, "min_ms": {"unconstrained": min(m["min_ms"] for m in unconstrained),
                                             "budget": min(m["min_ms"] for m in budgeted)},
            "latency_ratio": latency["budget"] / latency["unconstrained"],
            "min_latency_ratio": min(m["min_ms"] for m in budgeted) / min(m["min_ms"] for m in unconstrained),
            "latency_goal_met": latency["budget"] / latency["unconstrained"] <= TARGET_LATENCY_RATIO,
            "per_request": budgeted[-1]["per_request"], "rounds": rounds, "runs": runs,
            "measurements": {"unconstrained": unconstrained, "budget": budgeted}}


def render(r: dict) -> list[str]:
    p = r["per_request"]
    model = r["model"] + ("" if r["width"] == 1.0 else f" (vgg19 with every layer's channels scaled by {r['width']:g})")
    setup = (f"{r['weights_mb']:.1f} MB of weights in {r['cus']} CUs (`decompose --max-cu-size {r['max_cu_size']}`; "
             f"the largest CU holds {r['largest_cu_mb']:.1f} MB with its activations), `--memory-budget "
             f"{r['budget_mb']:g}`, policy strict, {r['runs']} timed runs per process, {r['rounds']} interleaved "
             "rounds of fresh processes.")
    latency = (f"| latency, median ms (min) | {r['median_ms']['unconstrained']:.0f} "
               f"({r['min_ms']['unconstrained']:.0f}) | {r['median_ms']['budget']:.0f} ({r['min_ms']['budget']:.0f}) |")
    rss = (f"- Peak RSS {r['peak_rss_mb']:.0f} MB against budget + baseline ({r['baseline_rss_mb']:.0f} MB) + 10% = "
           f"{r['rss_limit_mb']:.0f} MB: {'met' if r['rss_goal_met'] else 'not met'}.")
    ratio = (f"- Latency under the budget / unconstrained: {r['latency_ratio']:.2f} (goal <= {TARGET_LATENCY_RATIO}: "
             f"{'met' if r['latency_goal_met'] else 'not met'}); of the minimum latencies: {r['min_latency_ratio']:.2f}.")
    bytes_line = (f"- Per request: {p['bytes_loaded'] / MB:.0f} MB loaded, {p['bytes_evicted'] / MB:.0f} MB evicted, "
                  f"{p['wasted_bytes']:g} bytes wasted; prefetch hits {p['prefetch_hits']:g}, misses "
                  f"{p['prefetch_misses']:g}, already resident {p['already_resident']:g}.")
    return [f"### Memory tiers: {model} under a budget of {BUDGET_SHARE:.0%} of its weights", "", setup, "",
            "| | every CU resident | under the budget |", "|---|---|---|",
            f"| peak RSS (MB) | {r['peak_rss_unconstrained_mb']:.0f} | {r['peak_rss_mb']:.0f} |", latency, "",
            rss, ratio, bytes_line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)     # one child process's figures
    parser.add_argument("--budget-mb", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.budget_mb, args.runs, args.warmup)))
        return 0
    print(json.dumps(report(args.width, args.rounds, args.runs, args.warmup), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
