"""`make demo`: run every pipeline stage on one sample model and print what each produced."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path


def stages(model: Path, out: Path) -> list[tuple[str, list[str]]]:
    """The CLI calls that make up the pipeline, in order."""
    return [
        ("inspect", ["inspect", str(model)]),
        ("decompose", ["decompose", "--model-path", str(model), "--output-dir", str(out / "cus")]),
        ("build-dag", ["build-dag", "--cu-dir", str(out / "cus"), "--output", str(out / "dag.json")]),
        ("compile-wasm", ["compile-wasm", "--cu-dir", str(out / "cus"), "--dag", str(out / "dag.json"),
                          "--output", str(out / "wasm-bin"), "--opt-level", "3"]),
        ("run", ["run", str(out / "dag.json"), "--example-inputs", "--output", str(out / "outputs.npz"),
                 "--trace", str(out / "trace.json")]),
        ("verify", ["verify", str(out / "dag.json"), "--model", str(model)]),
        ("bench", ["bench", str(out / "dag.json"), "--repeat", "10", "--warmup", "2", "--top", "5"]),
        ("compile-cuda", ["compile-cuda", "--cu-dir", str(out / "cus"), "--dag", str(out / "dag.json"),
                          "--output", str(out / "cuda-bin")]),
        ("run cuda-sim", ["run", str(out / "dag.json"), "--device", "cuda-sim", "--example-inputs",
                          "--output", str(out / "outputs-cuda-sim.npz")]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", type=Path)
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    summary = []
    for name, argv in stages(args.model, args.out):
        print(f"\n$ cortex {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "cortex.cli", *argv])
        summary.append((name, rc, time.perf_counter() - start))
        if rc != 0:
            break
    print("\nDemo summary")
    for name, rc, seconds in summary:
        print(f"  {name:<14} {'ok' if rc == 0 else f'FAILED (exit {rc})':<18} {seconds:6.2f} s")
    sys.exit(0 if all(rc == 0 for _, rc, _ in summary) else 1)


if __name__ == "__main__":
    main()
