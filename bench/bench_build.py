"""What the compile cache saves on MiniLM: a clean `cortex build`, a rebuild with nothing changed, a
rebuild after changing one weight (one CU), and `--check`, each timed as the installed `cortex`
script run end to end (process start included). The incremental outputs are checked to be byte
for byte a clean build's. Prints a table for docs/benchmarks.md; run with `make bench-build`.

    python -m bench.bench_build [--targets wasm] [--json out/bench-build.json]
"""

from __future__ import annotations

import argparse
import json
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


def cortex(cwd: Path, *argv: str) -> tuple[float, dict]:
    start = time.perf_counter()
    result = subprocess.run([str(CORTEX), *argv, "--json"], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode not in (0, 1):
        sys.exit(f"error: cortex {' '.join(argv)} failed: {result.stderr.strip()}")
    return seconds, json.loads(result.stdout)


def change_one_weight(path: Path, name: str) -> None:
    model = onnx.load(path)
    (index,) = [i for i, t in enumerate(model.graph.initializer) if t.name == name]
    changed = numpy_helper.to_array(model.graph.initializer[index]).copy()
    changed.flat[0] += np.float32(0.01)
    model.graph.initializer[index].CopyFrom(numpy_helper.from_array(changed, name))
    onnx.save(model, path)


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "build.json"}


def measure(targets: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="cortex-bench-build-") as tmp:
        work = Path(tmp)
        shutil.copy(ensure_minilm(), work / "model.onnx")
        build = ["build", "model.onnx", "--output", "out", "--targets", targets, "--cache-dir", "cache", *OPTIONS]
        rows = {}
        rows["clean build"] = cortex(work, *build)
        rows["rebuild, nothing changed"] = cortex(work, *build)
        rows["--check, up to date"] = cortex(work, *build, "--check")
        change_one_weight(work / "model.onnx", CHANGED_WEIGHT)
        rows["--check, one weight changed"] = cortex(work, *build, "--check")
        rows["rebuild, one weight changed"] = cortex(work, *build)
        clean = ["build", "model.onnx", "--output", "clean", "--targets", targets, "--no-cache", *OPTIONS]
        rows["clean build of the changed model (--no-cache)"] = cortex(work, *clean)
        identical = tree(work / "out") == tree(work / "clean")
    base = rows["clean build"][0]
    return {"model": "MiniLM-L6 (batch 1, seq 128)", "targets": targets, "identical_to_clean": identical,
            "rows": [{"step": step, "seconds": round(s, 2), "ratio_to_clean": round(s / base, 3),
                      "compiled_cus": summary.get("compiled_cus"), "reused_cus": summary.get("reused_cus"),
                      "cus": summary.get("cus")} for step, (s, summary) in rows.items()]}


def table(result: dict) -> str:
    lines = [f"`cortex build` on {result['model']}, --targets {result['targets']} (`make bench-build`); "
             f"incremental outputs byte-identical to a clean build: {'yes' if result['identical_to_clean'] else 'NO'}.",
             "", "| step | seconds | x clean build | CUs compiled / reused |", "|---|---:|---:|---:|"]
    for row in result["rows"]:
        counts = "" if row["compiled_cus"] is None else f"{row['compiled_cus']} / {row['reused_cus']}"
        lines.append(f"| {row['step']} | {row['seconds']:.2f} | {row['ratio_to_clean']:.3f} | {counts} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="wasm")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.targets)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
