"""MiniLM built for seq 32, 64 and 128 in one bundle against one build for seq 128: bytes on disk,
and warm load time with weights embedded in the modules (the default) or in external files; and
the bundle's peak RSS for one seq-32 request, specializations loaded eagerly or lazily
(`bench/specialization_memory.py`).

    python -m bench.bench_specializations [--json OUT.json] [--folder DIR] [--loads N]

Bytes count every file of the output folder (cu.onnx folders, dag.json, modules, weight files),
leaving out the native-code cache the first load writes (`*.cwasm`, its stamps).
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
from bench.specialization_memory import memory_rows, render
from samples.minilm import ensure_minilm

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--folder", type=Path, help="where to build (default: a temporary folder)")
    parser.add_argument("--loads", type=int, default=3)
    args = parser.parse_args()
    model = ensure_minilm()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.folder or Path(tmp)
        rows = {}
        for i, (name, (shapes, options)) in enumerate(BUILDS.items()):
            dag = build(model, root / f"build-{i}", shapes, options)
            rows[name] = {"bytes": folder_bytes(dag.parent), "warm_load_s": round(warm_load_seconds(dag, args.loads), 4)}
        memory = memory_rows(dag)        # the last build: the specializations
    base = rows["seq=128, weights embedded"]
    for row in rows.values():
        row["bytes_ratio"] = round(row["bytes"] / base["bytes"], 4)
        row["load_ratio"] = round(row["warm_load_s"] / base["warm_load_s"], 3)
    print(f"{'build':34} {'bytes':>13} {'x one build':>11} {'warm load':>10} {'x':>6}")
    for name, row in rows.items():
        print(f"{name:34} {row['bytes']:>13,} {row['bytes_ratio']:>11.3f} {row['warm_load_s']:>9.3f}s "
              f"{row['load_ratio']:>6.2f}")
    print("\n" + "\n".join(render(memory)))
    if args.json:
        args.json.write_text(json.dumps({**rows, "memory": memory}, indent=2) + "\n")


if __name__ == "__main__":
    main()
