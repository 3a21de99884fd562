"""Memory tiers, measured: VGG under a memory budget of a quarter of its weights against the same
model with every CU resident (`make bench-runtime`; figures, never test assertions).

The model is samples/vgg.py's (vgg19 by default: 548 MB of random float32 weights), decomposed at
`cortex decompose`'s default limits (about 150 CUs of at most a million parameters: the first
fully connected layer alone is split into a hundred slices) and compiled with compile-wasm's
defaults. Each measurement is a fresh process (`measure`, below), so its peak RSS (VmHWM,
`process_maxrss_mb`: getrusage's ru_maxrss would carry the parent's peak over) is its own: every CU
resident on the machine's threads (the default), every CU resident on one thread, then under the
budget (which runs one CU at a time), interleaved over rounds, after one unmeasured process that
fills the native-code cache, so that every measured load is warm (compiling a CU to native code
takes more memory than running it). Reported:
- the runtime's own baseline: the RSS of a process that loaded the model under the budget, before
  its first request (no CU resident yet: the interpreter, the libraries, dag.json, the engine);
- peak RSS under the budget against budget + baseline + 10%;
- latency (wall-clock median of the timed runs, median over rounds) under the budget over the
  unconstrained one, against 1.25, and over the unconstrained one on one thread (what the budget
  costs when both run one CU at a time);
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
TARGET_LATENCY_RATIO = 1.25


def _cortex(*argv) -> None:
    subprocess.run([str(Path(sys.executable).parent / "cortex"), *map(str, argv)], check=True,
                   capture_output=True, text=True)


def build(width: float, out: Path) -> Path:
    """The compiled VGG at the default limits and options (kept under .cache/ between runs)."""
    model = ensure_vgg("E", width)
    dag_path = out / "dag.json"
    stamp = out / "built-with.json"
    wanted = {"model": model.name, "size": model.stat().st_size, "limits": "default"}
    if dag_path.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return dag_path
    _cortex("decompose", "--model-path", model, "--output-dir", out / "cus")
    _cortex("build-dag", "--cu-dir", out / "cus", "--output", dag_path)
    _cortex("compile-wasm", "--cu-dir", out / "cus", "--dag", dag_path, "--output", out / "wasm-bin")
    stamp.write_text(json.dumps(wanted))
    return dag_path


def measure(dag_path: Path, budget_mb: float | None, runs: int, warmup: int, threads: int | None = None) -> dict:
    """One process's figures (run by `_measure_in_child` in a fresh interpreter)."""
    import cortex

    # On one thread without a budget CUs would run in segments, which a budget turns off: the
    # one-thread figure is the budget's own cost when both walk the CUs one by one.
    model = cortex.load(dag_path, policy="strict", memory_budget_mb=budget_mb, threads=threads,
                        segments=threads != 1)
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
    return {"budget_mb": budget_mb, "threads": threads, "baseline_rss_mb": baseline, "peak_rss_mb": process_maxrss_mb(), "median_ms": statistics.median(seconds) * 1e3,
        "min_ms": min(seconds) * 1e3,
        "per_request": {key: statistics.median(m[key] for m in memories) for key in
                        ("bytes_loaded", "bytes_evicted", "wasted_bytes", "prefetch_hits", "prefetch_misses",
                         "already_resident", "peak_resident_bytes")}}


def _measure_in_child(dag_path: Path, budget_mb: float | None, runs: int, warmup: int,
                      threads: int | None = None) -> dict:
    argv = [sys.executable, "-m", "bench.memory_tiers_bench", "--measure", str(dag_path), "--runs", str(runs),
            "--warmup", str(warmup)] + ([] if budget_mb is None else ["--budget-mb", str(budget_mb)]) \
        + ([] if threads is None else ["--threads", str(threads)])
    result = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(result.stdout)


def report(width: float = 1.0, rounds: int = 3, runs: int = 3, warmup: int = 1) -> dict:
    out = CACHE_DIR / "bench-memory-tiers" / vgg_name("E", width)
    dag_path = build(width, out)
    dag = json.loads(dag_path.read_text())
    weights = sum(cu["artifacts"]["wasm"]["memory"]["weights_bytes"] for cu in dag["cus"])
    largest = max(cu["artifacts"]["wasm"]["memory"]["memory_bytes"] for cu in dag["cus"])
    budget_mb = round(BUDGET_SHARE * weights / MB, 1)
    _measure_in_child(dag_path, None, 1, 0)     # fills the native-code cache: every measured load is warm
    unconstrained, one_thread, budgeted = [], [], []
    for _ in range(rounds):
        unconstrained.append(_measure_in_child(dag_path, None, runs, warmup))
        one_thread.append(_measure_in_child(dag_path, None, runs, warmup, threads=1))
        budgeted.append(_measure_in_child(dag_path, budget_mb, runs, warmup))
    baseline = statistics.median(m["baseline_rss_mb"] for m in budgeted)
    peak = max(m["peak_rss_mb"] for m in budgeted)
    latency = {"unconstrained": statistics.median(m["median_ms"] for m in unconstrained),
               "one_thread": statistics.median(m["median_ms"] for m in one_thread),
               "budget": statistics.median(m["median_ms"] for m in budgeted)}
    rss_limit = (budget_mb + baseline) * (1 + RSS_MARGIN)
    return {"model": vgg_name("E", width), "width": width, "cus": len(dag["cus"]),
            "weights_mb": weights / MB, "largest_cu_mb": largest / MB, "budget_mb": budget_mb,
            "baseline_rss_mb": baseline, "peak_rss_mb": peak,
            "peak_rss_unconstrained_mb": max(m["peak_rss_mb"] for m in unconstrained),
            "rss_limit_mb": rss_limit, "rss_goal_met": peak <= rss_limit,
            "median_ms": latency, "min_ms": {"unconstrained": min(m["min_ms"] for m in unconstrained),
                                             "one_thread": min(m["min_ms"] for m in one_thread),
                                             "budget": min(m["min_ms"] for m in budgeted)},
            "latency_ratio": latency["budget"] / latency["unconstrained"],
            "one_thread_latency_ratio": latency["budget"] / latency["one_thread"],
            "min_latency_ratio": min(m["min_ms"] for m in budgeted) / min(m["min_ms"] for m in unconstrained),
            "latency_goal_met": latency["budget"] / latency["unconstrained"] <= TARGET_LATENCY_RATIO,
            "per_request": budgeted[-1]["per_request"], "rounds": rounds, "runs": runs,
            "measurements": {"unconstrained": unconstrained, "one_thread": one_thread, "budget": budgeted}}


def render(r: dict) -> list[str]:
    p = r["per_request"]
    model = r["model"] + ("" if r["width"] == 1.0 else f" (vgg19 with every layer's channels scaled by {r['width']:g})")
    setup = (f"{r['weights_mb']:.1f} MB of weights in {r['cus']} CUs (`decompose` and `compile-wasm` at their defaults; "
             f"the largest CU holds {r['largest_cu_mb']:.1f} MB with its activations), `--memory-budget "
             f"{r['budget_mb']:g}`, policy strict, {r['runs']} timed runs per process, {r['rounds']} interleaved "
             "rounds of fresh processes.")
    latency = (f"| latency, median ms (min) | {r['median_ms']['unconstrained']:.0f} "
               f"({r['min_ms']['unconstrained']:.0f}); one thread {r['median_ms']['one_thread']:.0f} "
               f"({r['min_ms']['one_thread']:.0f}) | {r['median_ms']['budget']:.0f} ({r['min_ms']['budget']:.0f}) |")
    rss = (f"- Peak RSS {r['peak_rss_mb']:.0f} MB against budget + baseline ({r['baseline_rss_mb']:.0f} MB) + 10% = "
           f"{r['rss_limit_mb']:.0f} MB: {'met' if r['rss_goal_met'] else 'not met'}.")
    ratio = (f"- Latency under the budget / unconstrained: {r['latency_ratio']:.2f} (goal <= {TARGET_LATENCY_RATIO}: "
             f"{'met' if r['latency_goal_met'] else 'not met'}); of the minimum latencies: {r['min_latency_ratio']:.2f}; "
             f"over every CU resident on one thread (both run one CU at a time): {r['one_thread_latency_ratio']:.2f}.")
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
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.budget_mb, args.runs, args.warmup, args.threads)))
        return 0
    print(json.dumps(report(args.width, args.rounds, args.runs, args.warmup), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
