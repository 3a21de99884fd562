"""`make bench-sandbox`: what the CU sandbox's time limit costs, measured (figures, never test assertions).

The same compiled model runs under the strict policy (every CU, every run) twice over, in one
process: with the sandbox's default deadlines (the engine compiles epoch checks into every
function entry and loop back-edge, each call sets its store's deadline, the ticker thread wakes
every TICK_SECONDS) and with `cu_timeout_ms=0` (no epoch checks, no deadlines). The memory limit
is on in both: it costs nothing per call. Contestants are interleaved round after round
(bench/timing.py); the figure is the ratio of median CPU times, sandboxed over unsandboxed, with
the minimums' ratio beside it. Outputs of the two must be bitwise equal.

    python -m bench.sandbox_overhead DAG.json [DAG.json ...] [--rounds 7] [--json out/bench-sandbox.json]

Without a DAG it builds MiniLM-L6 (batch 1, seq 128, its sample sentence as the feed) in a temporary
folder, compiled as `make bench` compiles it; a given DAG runs on `cortex run --example-inputs`' feeds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import cortex
from bench import machine
from bench.timing import InProcess, interleave, repeats_for
from cortex.commands.run import example_feeds
from ir.fs import write_bytes_atomically
from samples.minilm import ensure_minilm, minilm_feed


def _cortex(*argv) -> None:
    subprocess.run([str(Path(sys.executable).parent / "cortex"), *map(str, argv)], check=True,
                   capture_output=True, text=True)


def build_minilm(out: Path) -> Path:
    _cortex("decompose", "--model-path", ensure_minilm(), "--output-dir", out / "cus", "--dim", "batch=1", "--dim", "seq=128")
    _cortex("build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json")
    _cortex("compile-wasm", "--cu-dir", out / "cus", "--output", out / "wasm-bin", "--dag", out / "dag.json",
            "--features", "simd,relaxed-simd", "--opt-level", "3")
    return out / "dag.json"


def measure(dag_path: Path, rounds: int, feeds: dict | None = None) -> dict:
    sandboxed = cortex.load(dag_path, policy="strict")
    unsandboxed = cortex.load(dag_path, policy="strict", cu_timeout_ms=0)
    feeds = feeds or example_feeds(sandboxed.inputs)
    a, b = sandboxed.run(feeds), unsandboxed.run(feeds)
    equal = all(np.array_equal(a[name], b[name]) for name in a)
    probe = InProcess("probe", lambda: unsandboxed.run(feeds)).time(1, 3)
    repeat = repeats_for(min(cpu for _, cpu in probe))
    timings = interleave([InProcess("epoch deadlines", lambda: sandboxed.run(feeds)),
                          InProcess("no time limit", lambda: unsandboxed.run(feeds))], rounds, repeat)
    on, off = timings["epoch deadlines"], timings["no time limit"]
    return {"dag": str(dag_path), "cus": len(sandboxed.dag["cus"]), "runs_each": len(on.seconds),
            "median_ms": {"epoch deadlines": on.median * 1e3, "no time limit": off.median * 1e3},
            "min_ms": {"epoch deadlines": on.best * 1e3, "no time limit": off.best * 1e3},
            "median_ratio": on.median / off.median, "min_ratio": on.best / off.best,
            "outputs_bitwise_equal": equal, "timings": {name: t.to_json() for name, t in timings.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dags", nargs="*", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cortex-bench-sandbox-") as tmp:
        if args.dags:
            results = [measure(dag, args.rounds) for dag in args.dags]
        else:
            results = [measure(build_minilm(Path(tmp) / "minilm"), args.rounds, minilm_feed(1, 128))]
    for r in results:
        print(f"{r['dag']}: {r['cus']} CUs, strict, {r['runs_each']} runs each: epoch deadlines "
              f"{r['median_ms']['epoch deadlines']:.2f} ms vs no time limit {r['median_ms']['no time limit']:.2f} ms "
              f"median CPU: {r['median_ratio']:.3f}x (min {r['min_ratio']:.3f}x); outputs bitwise equal: "
              f"{r['outputs_bitwise_equal']}")
    if args.json:
        write_bytes_atomically(args.json, (json.dumps({"machine": machine.describe(), "results": results},
                                                      indent=2) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
