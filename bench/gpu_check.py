"""`make gpu-check`: the CUDA backend on a real GPU (needs an NVIDIA driver and a GPU).

For each model (the samples, the light models without the large ones, MiniLM-L6 at batch 1 x 128):
decompose -> build-dag -> compile-cuda -> run with `--device cuda`, check the outputs against
onnxruntime (CPU), then time Cortex on the GPU against onnxruntime's CUDA execution provider when
onnxruntime-gpu is installed, else against torch on CUDA when it is, else alone. It also runs the
ONNX-node conformance suite on the `cuda` device when the project has one (`make conformance`).

Prints a table and writes the results as JSON (--output). On a machine without a GPU it stops at
once with the one-line reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def build(case, out: Path, compiler: str) -> Path:
    from backends.cuda.build import compile_cu_dir
    from cortex.commands.decompose import decompose_model
    from cortex.dag import build_dag
    from ir.onnx_export import write_bytes_atomically
    decompose_model(Path(case.path), out / "cus", case.input_shapes or {}, case.dims or {}, 4096, 50_000_000, 8)
    dag_path = out / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out / "cus", dag_path), indent=2).encode())
    compile_cu_dir(out / "cus", out / "cuda-bin", ("sm_80", "sm_90"), compiler, dag_path)
    return dag_path


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: module loads, JIT, allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def reference_timer(case, repeats: int):
    """(name, median ms) of the fastest GPU reference available here, or None."""
    import onnxruntime as ort
    if "CUDAExecutionProvider" in ort.get_available_providers():
        session = ort.InferenceSession(str(case.path), providers=["CUDAExecutionProvider"])
        return "onnxruntime CUDA EP", median_ms(lambda: session.run(None, case.inputs), repeats)
    try:
        import onnx2torch  # noqa: F401  (optional: only when installed on the GPU machine)
        import torch
        if torch.cuda.is_available():
            module = onnx2torch.convert(str(case.path)).cuda().eval()
            feeds = [torch.from_numpy(np.asarray(v)).cuda() for v in case.inputs.values()]
            def run():
                with torch.no_grad():
                    module(*feeds)
                torch.cuda.synchronize()
            return "torch (CUDA)", median_ms(run, repeats)
    except ImportError:
        pass
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gpu-check")
    parser.add_argument("--output", type=Path, default=ROOT / "out" / "gpu-check.json")
    parser.add_argument("--compiler", default="auto", choices=["auto", "nvcc", "nvrtc"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--models", default="samples,light,minilm", help="comma-separated: samples, light, minilm")
    args = parser.parse_args()

    import cortex
    from backends.cuda.device import CudaDevice
    from ir.errors import CortexError
    from testdata import (LARGE_LIGHT_MODELS, LIGHT_MODEL_NAMES, SAMPLE_NAMES, assert_values_close, light_model,
                          minilm, sample_model)
    try:
        gpu = CudaDevice()
    except CortexError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    print(f"GPU: {gpu.name} ({gpu.arch})")

    groups = set(args.models.split(","))
    cases = []
    if "samples" in groups:
        cases += [sample_model(n) for n in SAMPLE_NAMES]
    if "light" in groups:
        cases += [light_model(n) for n in LIGHT_MODEL_NAMES if n not in LARGE_LIGHT_MODELS]
    if "minilm" in groups:
        cases.append(minilm(1, 128))

    results, failures = [], 0
    for case in cases:
        row = {"model": case.name}
        try:
            dag_path = build(case, args.out / case.name, args.compiler)
            model = cortex.load(dag_path, device="cuda")
            got = model.run(case.inputs)
            for name, want in case.outputs.items():
                assert_values_close(got[name], want, rtol=1e-3, atol=1e-4)
            row["matches_onnxruntime"] = True
            row["cortex_cuda_ms"] = median_ms(lambda: model.run(case.inputs), args.repeats)
            reference = reference_timer(case, args.repeats)
            if reference:
                row["reference"], row["reference_ms"] = reference
        except (AssertionError, CortexError) as e:
            failures += 1
            row["matches_onnxruntime"] = False
            row["error"] = " ".join(str(e).split())[:300]
        results.append(row)
        print(json.dumps(row), flush=True)

    conformance = None
    try:
        from cortex.conformance.devices import DEVICES as conformance_devices
    except ImportError:
        conformance_devices = ()
    if "cuda" in conformance_devices:
        conformance = subprocess.run(["make", "conformance", "DEVICE=cuda"], cwd=ROOT).returncode
        failures += conformance != 0
    else:
        print("conformance: the suite has no cuda device yet; run `make conformance DEVICE=cuda-sim` instead")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"gpu": gpu.name, "arch": gpu.arch, "models": results, "conformance_exit_code": conformance}
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(args.output)

    print(f"\n{'model':<28} {'ok':<4} {'cortex cuda ms':>15} {'reference ms':>13}  reference")
    for r in results:
        print(f"{r['model']:<28} {'yes' if r['matches_onnxruntime'] else 'NO':<4} {r.get('cortex_cuda_ms', float('nan')):>15.3f} "
              f"{r.get('reference_ms', float('nan')):>13.3f}  {r.get('reference', '-')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
