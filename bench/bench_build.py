"""What the compile cache saves on MiniLM: a clean `cortex build`, a rebuild with nothing changed, a
rebuild after changing one weight (one CU), and `--check`, each timed as the installed `cortex`
script run end to end (process start included): wall and CPU time of the process, the fastest of
`--repeat` runs, and the time the command itself reports. The incremental outputs are checked to be byte
for byte a clean build's. Prints a table for docs/benchmarks.md; run with `make bench-build`.

    python -m bench.bench_build [--targets wasm] [--repeat 3] [--json out/bench-build.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from samples.minilm import ensure_minilm

CORTEX = Path(sys.executable).with_name("cortex")
OPTIONS = ["--dim", "batch=1", "--dim", "seq=128"]
CHANGED_WEIGHT = "bert.encoder.layer.2.intermediate.dense.bias"   # one CU's: the layer's first FFN MatMul


def cortex(cwd: Path, *argv: str) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of the process, its --json summary)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([str(CORTEX), *argv, "--json"], check=False, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode not in (0, 1):
        sys.exit(f"error: cortex {' '.join(argv)} failed: {result.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(result.stdout)


def set_one_weight(source: Path, path: Path, name: str, delta: float) -> None:
    """`source` with the first element of initializer `name` moved by `delta`, written to `path`."""
    model = onnx.load(source)
    (index,) = [i for i, t in enumerate(model.graph.initializer) if t.name == name]
    changed = numpy_helper.to_array(model.graph.initializer[index]).copy()
    changed.flat[0] += np.float32(delta)
    model.graph.initializer[index].CopyFrom(numpy_helper.from_array(changed, name))
    onnx.save(model, path)


def fastest(runs: list[tuple[float, float, dict]]) -> tuple[float, float, dict]:
    """The least wall time and the least CPU time of the repeats (the machine may be shared)."""
    return min(r[0] for r in runs), min(r[1] for r in runs), runs[-1][2]


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "build.json"}


def measure(targets: str, repeat: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="cortex-bench-build-") as tmp:
        work = Path(tmp)
        source = ensure_minilm()
        shutil.copy(source, work / "model.onnx")

        def build(out: str, cache: str, *more: str):
            return cortex(work, "build", "model.onnx", "--output", out, "--targets", targets,
                          "--cache-dir", cache, *OPTIONS, *more)

        rows = {"clean build (empty cache)": fastest([build(f"clean-{i}", f"cache-{i}") for i in range(repeat)])}
        build("out", "cache")
        rows["rebuild, nothing changed"] = fastest([build("out", "cache") for _ in range(repeat)])
        rows["--check, up to date"] = fastest([build("out", "cache", "--check") for _ in range(repeat)])
        one = []
        for i in range(repeat):     # a new value each time, so each rebuild has exactly one new CU
            set_one_weight(source, work / "model.onnx", CHANGED_WEIGHT, 0.01 * (i + 1))
            one.append(build("out", "cache"))
            assert all(c["compiled_cus"] == 1 for c in one[-1][2]["compile"].values()), one[-1][2]
        rows["rebuild, one weight changed (one CU)"] = fastest(one)
        build("changed-clean", "unused", "--no-cache")
        identical = tree(work / "out") == tree(work / "changed-clean")
    base_wall, base_cpu, _ = rows["clean build (empty cache)"]
    return {"model": "MiniLM-L6 (batch 1, seq 128)", "targets": targets, "repeat": repeat,
            "identical_to_clean": identical,
            "rows": [{"step": step, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                      "in_process_s": summary.get("seconds"), "wall_ratio": round(wall / base_wall, 3),
                      "cpu_ratio": round(cpu / base_cpu, 3), "compiled_cus": summary.get("compiled_cus"),
                      "reused_cus": summary.get("reused_cus")} for step, (wall, cpu, summary) in rows.items()]}


def table(result: dict) -> str:
    identical = "yes" if result["identical_to_clean"] else "NO"
    lines = [(f"`cortex build` on {result['model']}, --targets {result['targets']}: the fastest of "
              f"{result['repeat']} runs of the `cortex` script, process start included (`make bench-build`). "
              f"Incremental outputs byte-identical to a clean build: {identical}."),
             "", "| step | wall s | CPU s | CPU x clean build | in-command s | CUs compiled / reused |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        counts = "" if row["compiled_cus"] is None else f"{row['compiled_cus']} / {row['reused_cus']}"
        inside = "" if row["in_process_s"] is None else f"{row['in_process_s']:.2f}"
        lines.append(f"| {row['step']} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | {row['cpu_ratio']:.3f} | "
                     f"{inside} | {counts} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="wasm")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.targets, args.repeat)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
