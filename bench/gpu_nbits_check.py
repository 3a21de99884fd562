"""MatMulNBits on a real GPU: `python -m bench.gpu_nbits_check` compiles one com.microsoft
MatMulNBits node per case (4-bit blocks of 32 by default, symmetric and with packed zero points, at
accuracy levels 0 and 4) with compile-cuda, runs it with `--device cuda` and compares it with
onnxruntime (CPU) on the same model; it also times the CU's launches alone (inputs already on the
GPU; timed from the host, so each launch's overhead is in it) and gives the bandwidth that makes on
the stored weight bytes, and checks that the CU holds the narrow bytes (its weights against a
float32 MatMul's N x K x 4). One JSON report (`--output`).

`--dry-run` runs the same steps on cuda-sim with small shapes, to check the script where there is
no GPU (its times say nothing about a GPU). Without a GPU (and no --dry-run), or without a CUDA
compiler, it stops with one line and exit code 2 before writing anything; exit code 1 when a case's
outputs differ from onnxruntime.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

import cortex
from backends.cuda.build import CudaOptions
from backends.cuda.toolchain import choose_compiler, find_nvcc, nvcc_version, nvrtc_version
from bench.gpu_timing import compile_dag, median_ms
from ir.errors import CortexError
from ir.fs import write_bytes_atomically

GPU_SHAPES = "1x4096x4096,16x4096x4096,1x11008x4096"   # M x N x K: a decoder step, a short prefill, an MLP's up
DRY_SHAPES = "1x96x200,5x40x136"
LEVELS = (0, 4)
# The kernel and onnxruntime sum in different orders: each output within this share of the largest.
RELATIVE_TOLERANCE = 1e-4


def nbits_model(m: int, n: int, k: int, bits: int, block: int, level: int, zero_points: bool,
                seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One MatMulNBits node with random codes, scales of about 1 / sqrt(K) and (with `zero_points`)
    packed zero point codes; and its feed."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    constants = {"b": rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8),
                 "scales": (rng.random(n * blocks) * 2 / np.sqrt(k) + 0.01).astype(np.float32)}
    inputs = ["a", "b", "scales"]
    if zero_points:
        constants["zero_points"] = rng.integers(0, 256, n * -(-blocks * bits // 8), dtype=np.uint8)
        inputs.append("zero_points")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=level)
    graph = helper.make_graph([node], "matmul_nbits", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [m, n])],
                              [numpy_helper.from_array(v, name) for name, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model, {"a": rng.standard_normal((m, k)).astype(np.float32)}


def launch_ms(model, feed: dict, repeats: int) -> float:
    """Median time of the CU's launches alone, its input already on the device."""
    scheduler = model.scheduler
    (cu,) = scheduler.dag["cus"]
    device = scheduler.devices[scheduler.placement[cu["id"]]]
    inputs = {name: device.to_device(feed[name]) for name in cu["inputs"]}
    synchronize = getattr(getattr(device, "gpu", None), "synchronize", lambda: None)

    def run():
        device.run(cu, inputs)
        synchronize()
    return median_ms(run, repeats)


def check_case(out: Path, device: str, options: CudaOptions, shape: tuple[int, int, int], bits: int, block: int,
               level: int, zero_points: bool, repeats: int) -> dict:
    m, n, k = shape
    name = f"{m}x{n}x{k}-q{bits}-b{block}-level{level}{'-zp' if zero_points else ''}"
    model, feed = nbits_model(m, n, k, bits, block, level, zero_points)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    row = {"case": name, "m": m, "n": n, "k": k, "bits": bits, "block": block, "accuracy_level": level,
           "zero_points": zero_points}
    try:
        dag_path = compile_dag(folder / "model.onnx", folder, options, jobs=1)
        loaded = cortex.load(dag_path, device=device, policy="strict")
        got = loaded.run(feed)["y"]
    except CortexError as e:
        return {**row, "error": " ".join(str(e).split())[:300], "matches_onnxruntime": False}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feed)[0]
    (cu,) = json.loads(dag_path.read_text())["cus"]
    record = cu["artifacts"]["cuda"]
    largest = float(np.abs(want).max())
    error = float(np.abs(got - want).max())
    ms = launch_ms(loaded, feed, repeats)
    weight_bytes = record["weights"]["bytes"]
    return {**row, "max_error": error, "largest_output": largest, "relative_error": error / largest,
            "matches_onnxruntime": error <= RELATIVE_TOLERANCE * largest,
            "weight_bytes": weight_bytes, "float32_bytes": 4 * n * k, "weight_share": weight_bytes / (4 * n * k),
            "kernels": [launch["kernel"] for launch in record["launches"]],
            "registers": {arch: {kernel: r["registers"] for kernel, r in kernels.items()}
                          for arch, kernels in record.get("resources", {}).items()},
            "launch_ms": ms, "weight_gb_per_s": weight_bytes / ms / 1e6}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="cuda-sim with small shapes (no GPU needed)")
    p.add_argument("--shapes", help=f"comma-separated MxNxK (default {GPU_SHAPES}; dry run {DRY_SHAPES})")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 50, dry run 1)")
    p.add_argument("--compiler", default="auto", choices=("auto", "nvcc", "nvrtc"))
    p.add_argument("--out", type=Path, default=Path("out/gpu-nbits-check"), help="build folder")
    p.add_argument("--output", type=Path, default=Path("out/gpu-nbits-check.json"), help="the JSON report")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.dry_run:
            gpu, arch, device = "none (cuda-sim)", "sm_90", "cuda-sim"
        else:
            from backends.cuda.driver import CudaDevice
            probe = CudaDevice()          # no driver or no GPU: one line, nothing written
            gpu, arch, device = probe.name, probe.arch, "cuda"
        compiler = choose_compiler(args.compiler)
        shapes = [tuple(int(d) for d in s.split("x")) for s in (args.shapes or (DRY_SHAPES if args.dry_run else GPU_SHAPES)).split(",")]
        if any(len(s) != 3 for s in shapes):
            raise ValueError("--shapes: expected MxNxK, comma-separated")
    except (CortexError, ValueError) as e:
        print(f"gpu-nbits-check: {e}", file=sys.stderr)
        return 2
    repeats = args.repeats or (1 if args.dry_run else 50)
    options = CudaOptions(arch=(arch,), compiler=compiler)
    print(f"GPU: {gpu} ({arch}); compiler: {compiler}", flush=True)
    cases = []
    for shape in shapes:
        for level in LEVELS:
            for zero_points in (False, True):
                cases.append(check_case(args.out, device, options, shape, args.bits, args.block, level, zero_points, repeats))
                print(json.dumps(cases[-1]), flush=True)
    document = {"gpu": gpu, "arch": arch, "device": device, "dry_run": args.dry_run,
                "compiler": f"nvcc {nvcc_version(find_nvcc())}" if compiler == "nvcc" else f"NVRTC {nvrtc_version()}",
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "relative_tolerance": RELATIVE_TOLERANCE, "repeats": repeats, "cases": cases}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(args.output, (json.dumps(document, indent=2) + "\n").encode())
    print(f"wrote {args.output}")
    return 0 if all(c["matches_onnxruntime"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
