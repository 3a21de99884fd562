"""Memory of a shape-specialized bundle: a fresh process loads it and runs one request, with the
specializations loaded eagerly (all of them at load, as before lazy loading) or lazily (only the
one the request picks).

    python -m bench.specialization_memory DAG [--seq 32]

Each row is its own interpreter (its VmHWM is its own, `process_maxrss_mb`), started after a load
that warmed every specialization's native-code cache: VmRSS after the imports and right after
`cortex.load`, and the peak after the request. `bench.bench_specializations` runs it on MiniLM for
seq 32, 64 and 128 (`make bench-specializations`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import cortex
from cortex.runtime.trace import process_maxrss_mb, process_rss_mb
from samples.minilm import minilm_feed

LOADINGS = ("eager", "lazy")


def measure(dag: Path, loading: str, seq: int) -> dict:
    """This process's memory around loading `dag` and running one MiniLM request of length `seq`."""
    imports = process_rss_mb()
    model = cortex.load(dag, specializations=loading)
    loaded = process_rss_mb()
    model.run(minilm_feed(1, seq))
    return {"imports_rss_mb": round(imports, 1), "after_load_rss_mb": round(loaded, 1),
            "peak_rss_mb": round(process_maxrss_mb(), 1), "loaded": model.loaded_specializations()}


def memory_rows(dag: Path, seq: int = 32) -> dict:
    cortex.load(dag, specializations="eager")      # warms every specialization's native-code cache
    rows = {}
    for loading in LOADINGS:
        argv = [sys.executable, "-m", "bench.specialization_memory", str(dag), "--seq", str(seq),
                "--measure", loading]
        result = subprocess.run(argv, check=True, capture_output=True, text=True)
        rows[f"{loading}, one seq={seq} request"] = json.loads(result.stdout)
    eager, lazy = rows.values()
    lazy["peak_ratio"] = round(lazy["peak_rss_mb"] / eager["peak_rss_mb"], 3)
    return rows


def render(rows: dict) -> list[str]:
    lines = [f"{'specializations loaded':34} {'after imports':>13} {'after load':>11} {'peak RSS':>10} {'x':>6}"]
    for name, row in rows.items():
        lines.append(f"{name:34} {row['imports_rss_mb']:>10.1f} MB {row['after_load_rss_mb']:>8.1f} MB "
                     f"{row['peak_rss_mb']:>7.1f} MB {row.get('peak_ratio', 1.0):>6.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dag", type=Path)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--measure", choices=LOADINGS, help=argparse.SUPPRESS)     # one child's row
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.dag, args.measure, args.seq)))
        return
    rows = memory_rows(args.dag, args.seq)
    print("\n".join(render(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
