"""MiniLM built for seq 32, 64 and 128 in one bundle against one build for seq 128: bytes on disk,
warm load time with weights embedded in the modules (the default) or in external files, and the
memory of loading the bundle and running one seq-32 request with its specializations loaded
lazily (the default: only seq=32's CUs) or eagerly (all three, as before lazy loading).

    python -m bench.bench_specializations [--json OUT.json] [--folder DIR] [--loads N]

Bytes count every file of the output folder (cu.onnx folders, dag.json, modules, weight files),
leaving out the native-code cache the first load writes (`*.cwasm`, its stamps). Memory is
measured in a fresh process per row (`--measure-rss`, after a load that warmed the native-code
cache): VmRSS after the imports and after `cortex.load`, and the process's peak (VmHWM,
`process_maxrss_mb`) after the request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cortex
from cortex.runtime.trace import process_maxrss_mb
from samples.minilm import ensure_minilm, minilm_feed

CORTEX = Path(sys.executable).with_name("cortex")
BUILDS = {
    "seq=128, weights embedded": (["--dim", "seq=128"], []),
    "seq=128, --external-weights": (["--dim", "seq=128"], ["--external-weights"]),
    "seq=32,64,128 specializations": (["--dim", "seq=32,64,128"], []),
}


def build(model: Path, out: Path, shapes: list[str], compile_options: list[str]) -> Path:
    for argv in (["decompose", "--model-path", model, "--output-dir", out / "cus", "--dim", "batch=1", *shapes],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 ["compile-wasm", "--cu-dir", out / "cus", "--output", out / "wasm-bin", "--dag", out / "dag.json",
                  *compile_options]):
        subprocess.run([str(CORTEX), *map(str, argv), "--json"], check=True, capture_output=True)
    return out / "dag.json"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and ".cwasm" not in p.name and p.name != "cwasm.verified.json")


def warm_load_seconds(dag: Path, loads: int) -> float:
    cortex.load(dag)          # the first load compiles and caches the native code
    seconds = []
    for _ in range(loads):
        start = time.perf_counter()
        cortex.load(dag)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def current_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure_rss(dag: Path, loading: str, seq: int) -> dict:
    """This process's memory around loading `dag` and running one request of length `seq`."""
    imports = current_rss_mb()
    model = cortex.load(dag, specializations=loading)
    loaded = current_rss_mb()
    model.run(minilm_feed(1, seq))
    return {"imports_rss_mb": round(imports, 1), "after_load_rss_mb": round(loaded, 1),
            "peak_rss_mb": round(process_maxrss_mb(), 1), "loaded": model.loaded_specializations()}


def rss_rows(dag: Path, seq: int = 32) -> dict:
    cortex.load(dag, specializations="eager")      # warms every specialization's native-code cache
    rows = {}
    for loading in ("eager", "lazy"):
        argv = [sys.executable, "-m", "bench.bench_specializations", "--measure-rss", str(dag),
                "--specializations", loading, "--seq", str(seq)]
        rows[f"{loading}, one seq={seq} request"] = json.loads(subprocess.run(argv, check=True, capture_output=True,
                                                                              text=True).stdout)
    eager, lazy = rows.values()
    lazy["peak_ratio"] = round(lazy["peak_rss_mb"] / eager["peak_rss_mb"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--folder", type=Path, help="where to build (default: a temporary folder)")
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--measure-rss", type=Path, help=argparse.SUPPRESS)     # one child process's row
    parser.add_argument("--specializations", default="lazy", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=32, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_rss:
        print(json.dumps(measure_rss(args.measure_rss, args.specializations, args.seq)))
        return
    model = ensure_minilm()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.folder or Path(tmp)
        rows = {}
        for i, (name, (shapes, options)) in enumerate(BUILDS.items()):
            dag = build(model, root / f"build-{i}", shapes, options)
            rows[name] = {"bytes": folder_bytes(dag.parent), "warm_load_s": round(warm_load_seconds(dag, args.loads), 4)}
        memory = rss_rows(dag)          # the last build: the specializations
    base = rows["seq=128, weights embedded"]
    for row in rows.values():
        row["bytes_ratio"] = round(row["bytes"] / base["bytes"], 4)
        row["load_ratio"] = round(row["warm_load_s"] / base["warm_load_s"], 3)
    print(f"{'build':34} {'bytes':>13} {'x one build':>11} {'warm load':>10} {'x':>6}")
    for name, row in rows.items():
        print(f"{name:34} {row['bytes']:>13,} {row['bytes_ratio']:>11.3f} {row['warm_load_s']:>9.3f}s "
              f"{row['load_ratio']:>6.2f}")
    print(f"\n{'seq=32,64,128 bundle':34} {'after imports':>13} {'after load':>11} {'peak RSS':>10} {'x':>6}")
    for name, row in memory.items():
        print(f"{name:34} {row['imports_rss_mb']:>10.1f} MB {row['after_load_rss_mb']:>8.1f} MB "
              f"{row['peak_rss_mb']:>7.1f} MB {row.get('peak_ratio', 1.0):>6.2f}")
    if args.json:
        args.json.write_text(json.dumps({**rows, "memory": memory}, indent=2) + "\n")


if __name__ == "__main__":
    main()
