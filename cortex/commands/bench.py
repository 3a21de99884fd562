"""`cortex bench DAG`: how fast a compiled model runs, and which CUs the time goes to.

Inputs come from --input files or, by default, the deterministic example inputs of `cortex run`.
After --warmup untimed runs, --repeat timed runs give the median and the minimum wall time of a
whole run; the runtime's trace gives each CU's share (median over the same runs).

It takes `cortex run`'s runtime options (`RuntimeOptions`' fields) but those of the result cache
and of padding: `--policy` (strict by default here), `--memory-budget`, `--pin`, `--threads`,
the sandbox's limits and the executor. The
report holds the process's peak RSS and the memory tiers' byte counts summed over the timed runs.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from cortex.commands.generated_options import with_options
from cortex.commands.run import example_feeds, read_inputs
from cortex.commands.shared_options import DeviceOption
from cortex.console import out, print_json
from cortex.runtime import load
from cortex.runtime.options import RuntimeOptions
from cortex.runtime.trace import process_maxrss_mb
from ir.errors import CortexError


# Strict by default here, so every run runs every CU: the result cache would time lookups, not the CUs.
@with_options(RuntimeOptions, into="runtime", defaults={"policy": "strict"},
              exclude=("trust_threshold", "cache_bytes", "pad_to_bucket", "pad_value"))
def bench(
    dag: Annotated[Path, typer.Argument(help="The dag.json, compiled for the device.")],
    runtime: RuntimeOptions,
    repeat: Annotated[int, typer.Option("--repeat", help="Timed runs.")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed runs first (caches, lazy set-up).")] = 3,
    input: Annotated[Optional[list[str]], typer.Option("--input", help="NAME=FILE.npy, or FILE.npz holding inputs by name (repeatable); others get example inputs.")] = None,
    device: DeviceOption = "wasm",
    top: Annotated[int, typer.Option("--top", help="CUs to list, slowest first (0: all).")] = 10,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable report.")] = False,
) -> None:
    """Time a compiled model: median and min of N runs, and a per-CU breakdown."""
    if repeat < 1:
        raise CortexError(f"--repeat must be at least 1, got {repeat}")
    if warmup < 0:
        raise CortexError(f"--warmup cannot be negative, got {warmup}")
    if top < 0:
        raise CortexError(f"--top cannot be negative, got {top}")
    feeds = read_inputs(input or [])
    start = time.perf_counter()
    model = load(dag, device, options=runtime)
    load_s = time.perf_counter() - start
    feeds = {**example_feeds(model.inputs), **feeds}
    for _ in range(warmup):
        model.run(feeds)
    runs, overheads, per_cu, traces = measure(model, feeds, repeat)
    report = summarize(dag, device, load_s, runs, overheads, per_cu)
    report.update(policy=runtime.policy.name, memory_budget_mb=runtime.memory_budget_mb, peak_rss_mb=process_maxrss_mb(),
                  memory=memory_totals(traces), threads=getattr(model, "threads", runtime.threads))
    if json:
        print_json(report)
        return
    _print(report, top)


def measure(model, feeds: dict, repeat: int) -> tuple[list[float], list[float], dict[str, dict], list[dict]]:
    """Wall seconds of each run, what of each run the CUs did not account for (the runtime moving
    tensors and checking inputs), per CU its op types and seconds in each run, and each run's trace."""
    traces: list[dict] = []
    runs: list[float] = []
    overheads: list[float] = []
    per_cu: dict[str, dict] = {}
    for _ in range(repeat):
        start = time.perf_counter()
        model.run(feeds)
        runs.append(time.perf_counter() - start)
        overheads.append(max(runs[-1] - sum(event["seconds"] for event in model.trace), 0.0))
        for event in model.trace:
            entry = per_cu.setdefault(event["cu"], {"op_types": event.get("op_types", []), "seconds": [],
                                                    "in_segment": "segment" in event})
            entry["seconds"].append(event["seconds"])
        traces.append(model.last_trace)
    return runs, overheads, per_cu, traces


MEMORY_COUNTS = ("bytes_loaded", "bytes_evicted", "wasted_bytes", "loads", "evictions", "prefetch_hits",
                 "prefetch_misses", "already_resident")


def memory_totals(traces: list[dict]) -> dict | None:
    """The memory tiers' counts summed over the runs, with the budget and the peak resident bytes."""
    memories = [t["memory"] for t in traces if t.get("memory") is not None]
    if not memories:
        return None
    return {"budget_bytes": memories[-1]["budget_bytes"], "pinned_cus": memories[-1]["pinned_cus"],
            "peak_resident_bytes": max(m["peak_resident_bytes"] for m in memories),
            **{key: sum(m[key] for m in memories) for key in MEMORY_COUNTS}}


def summarize(dag: Path, device: str, load_s: float, runs: list[float], overheads: list[float],
              per_cu: dict[str, dict]) -> dict:
    median = statistics.median(runs)
    cus = [{"cu": cu, "op_types": entry["op_types"], "median_ms": statistics.median(entry["seconds"]) * 1e3,
            "min_ms": min(entry["seconds"]) * 1e3, "in_segment": entry["in_segment"]} for cu, entry in per_cu.items()]
    cu_total = sum(c["median_ms"] for c in cus) or 1.0
    for c in cus:
        c["share"] = c["median_ms"] / cu_total
    cus.sort(key=lambda c: (-c["median_ms"], c["cu"]))
    return {"dag": str(dag), "device": device, "runs": len(runs), "load_ms": load_s * 1e3,
            "median_ms": median * 1e3, "min_ms": min(runs) * 1e3, "max_ms": max(runs) * 1e3,
            "overhead_ms": statistics.median(overheads) * 1e3, "cus": cus}


def _print(report: dict, top: int) -> None:
    out.print(f"{report['dag']} on {report['device']}: median {report['median_ms']:.2f} ms, "
              f"min {report['min_ms']:.2f} ms over {report['runs']} runs "
              f"(load {report['load_ms']:.1f} ms, runtime overhead {report['overhead_ms']:.2f} ms per run); "
              f"policy {report['policy']}, peak RSS {report['peak_rss_mb']:.1f} MB")
    memory = report["memory"]
    if memory and memory["budget_bytes"] is not None:
        out.print(f"memory budget {memory['budget_bytes'] / 2**20:g} MB: peak resident {memory['peak_resident_bytes'] / 2**20:.1f} MB, "
                  f"{memory['bytes_loaded'] / 2**20:.1f} MB loaded, {memory['bytes_evicted'] / 2**20:.1f} MB evicted, "
                  f"{memory['wasted_bytes'] / 2**20:.1f} MB wasted; prefetch {memory['prefetch_hits']} hits, "
                  f"{memory['prefetch_misses']} misses over {report['runs']} runs")
    shown = report["cus"] if top == 0 else report["cus"][:top]
    in_segments = sum(1 for c in report["cus"] if c.get("in_segment"))
    caption = (f"{in_segments} CUs ran in segments: their times are their segment's, shared out by estimated "
               "flops (--no-segments times each CU)") if in_segments else None
    table = Table(title=f"CUs, slowest first ({len(shown)} of {len(report['cus'])})", caption=caption)
    for col in ("CU", "ops", "median ms", "min ms", "share"):
        table.add_column(col, justify="left" if col in ("CU", "ops") else "right")
    for c in shown:
        ops = ", ".join(c["op_types"][:6]) + (" ..." if len(c["op_types"]) > 6 else "")
        table.add_row(c["cu"], ops, f"{c['median_ms']:.3f}", f"{c['min_ms']:.3f}", f"{c['share']:.1%}")
    out.print(table)
