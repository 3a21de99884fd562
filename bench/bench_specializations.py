"""MiniLM built for seq 32, 64 and 128 in one bundle against one build for seq 128: bytes on disk,
and warm load time with weights embedded in the modules (the default) or in external files; and
the bundle's peak RSS for one seq-32 request, specializations loaded eagerly or lazily
(`bench/specialization_memory.py`). `--targets cuda` (or `wasm,cuda`) measures compile-cuda's
bundles too: bytes only (cuda-sim would time the host emulation, not a GPU).

    python -m bench.bench_specializations [--json OUT.json] [--folder DIR] [--loads N] [--targets wasm,cuda]

Bytes count every file of the output folder (cu.onnx folders, dag.json, modules, weight files),
leaving out the native-code cache the first load writes (`*.cwasm`, its stamps); the CUDA rows
also give the cuda-bin folder alone (sources, PTX, cubins and weights).
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


CUDA_BUILDS = {
    "cuda seq=128": ["--dim", "seq=128"],
    "cuda seq=32,64,128 specializations": ["--dim", "seq=32,64,128"],
}


def build(model: Path, out: Path, shapes: list[str], compile_options: list[str], target: str = "wasm") -> Path:
    for argv in (["decompose", "--model-path", model, "--output-dir", out / "cus", "--dim", "batch=1", *shapes],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 [f"compile-{target}", "--cu-dir", out / "cus", "--output", out / f"{target}-bin",
                  "--dag", out / "dag.json", *compile_options]):
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
    parser.add_argument("--targets", default="wasm", help="comma-separated: wasm (bytes and warm loads), "
                        "cuda (bytes)")
    args = parser.parse_args()
    targets = {t.strip() for t in args.targets.split(",")}
    model = ensure_minilm()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.folder or Path(tmp)
        rows = {}
        for i, (name, (shapes, options)) in enumerate(BUILDS.items() if "wasm" in targets else ()):
            dag = build(model, root / f"build-{i}", shapes, options)
            rows[name] = {"bytes": folder_bytes(dag.parent), "warm_load_s": round(warm_load_seconds(dag, args.loads), 4)}
        memory = memory_rows(dag) if rows else None     # the last wasm build: the specializations
        cuda_rows = {}
        for i, (name, shapes) in enumerate(CUDA_BUILDS.items() if "cuda" in targets else ()):
            dag = build(model, root / f"cuda-{i}", shapes, [], target="cuda")
            cuda_rows[name] = {"bytes": folder_bytes(dag.parent),
                               "cuda_bin_bytes": folder_bytes(dag.parent / "cuda-bin")}
    if rows:
        base = rows["seq=128, weights embedded"]
        for row in rows.values():
            row["bytes_ratio"] = round(row["bytes"] / base["bytes"], 4)
            row["load_ratio"] = round(row["warm_load_s"] / base["warm_load_s"], 3)
        print(f"{'build':34} {'bytes':>13} {'x one build':>11} {'warm load':>10} {'x':>6}")
        for name, row in rows.items():
            print(f"{name:34} {row['bytes']:>13,} {row['bytes_ratio']:>11.3f} {row['warm_load_s']:>9.3f}s "
                  f"{row['load_ratio']:>6.2f}")
        print("\n" + "\n".join(render(memory)))
    if cuda_rows:
        one = cuda_rows["cuda seq=128"]
        print(f"\n{'build':34} {'bytes':>13} {'x one build':>11} {'cuda-bin':>13} {'x':>6}")
        for name, row in cuda_rows.items():
            row["bytes_ratio"] = round(row["bytes"] / one["bytes"], 4)
            row["cuda_bin_ratio"] = round(row["cuda_bin_bytes"] / one["cuda_bin_bytes"], 4)
            print(f"{name:34} {row['bytes']:>13,} {row['bytes_ratio']:>11.3f} {row['cuda_bin_bytes']:>13,} "
                  f"{row['cuda_bin_ratio']:>6.3f}")
        rows.update(cuda_rows)
    if args.json:
        args.json.write_text(json.dumps({**rows, **({"memory": memory} if memory else {})}, indent=2) + "\n")


if __name__ == "__main__":
    main()
