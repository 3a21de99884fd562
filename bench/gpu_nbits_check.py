"""MatMulNBits on a real GPU: `python -m bench.gpu_nbits_check` compiles one com.microsoft
MatMulNBits node per case (4-bit blocks of 32 by default, symmetric and with packed zero points, at
accuracy levels 0 and 4) with compile-cuda, runs it with `--device cuda` and compares it with
onnxruntime (CPU) on the same model; it also times the CU's launches alone (inputs already on the
GPU; timed from the host, so each launch's overhead is in it) and gives the bandwidth that makes on
the stored weight bytes, and checks that the CU holds the narrow bytes (its weights against a
float32 MatMul's N x K x 4). One JSON report (`--output`).

It also checks one product of each `--variants` precision (bf16, fp16, int8: a float32 MatMul of
`--variant-shape` compiled with those variants, whose CUs read the narrow weight in
backends/cuda/narrow_gemv.py's kernel): each variant's CU, run on the device, against onnxruntime on
the narrowed product built here by code (Cast of the bf16 / fp16 weight, or Mul of the Cast int8
codes by a scale per column, then the MatMul), with its weight bytes and their GB/s over its launches
(the report's `variants`).

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
from backends.registry import device as device_spec
from backends.registry import target
from backends.cuda.toolchain import choose_compiler, find_nvcc, nvcc_version, nvrtc_version
from bench.gpu_timing import compile_dag, median_ms
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from cortex.runtime.variants import variant_record
from ir.errors import CortexError
from ir.fs import write_bytes_atomically
from passes.narrow_weights import STORED, quantize_per_channel
from passes.partition import PartitionIntoCUs
from samples.nbits_models import matmul_nbits_model

GPU_SHAPES = "1x4096x4096,16x4096x4096,1x11008x4096"   # M x N x K: a decoder step, a short prefill, an MLP's up
DRY_SHAPES = "1x96x200,5x40x136"
LEVELS = (0, 4)
GPU_VARIANT_SHAPE = "1x4096x4096"
DRY_VARIANT_SHAPE = "3x72x200"
VARIANTS = ("bf16", "fp16", "int8")
# The kernel and onnxruntime sum in different orders: each output within this share of the largest.
RELATIVE_TOLERANCE = 1e-4


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
    model, feed = matmul_nbits_model(m, n, k, bits, block, level, zero_points)
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


def variant_models(m: int, n: int, k: int, seed: int = 0) -> tuple[onnx.ModelProto, dict, dict[str, np.ndarray]]:
    """The float32 MatMul a[m, k] @ w[k, n] that compile-cuda --variants narrows; the narrowed product
    of each variant precision, built by code as the variant stores it (w rounded to bf16 or fp16 and
    Cast back; int8 codes per column Cast and multiplied by their scales); and the feed."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    a_info = helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [m, k])
    y_info = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [m, n])

    def model(nodes, weights):
        graph = helper.make_graph(nodes, "matmul", [a_info], [y_info], weights)
        made = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        made.ir_version = 8
        return made
    exact = model([helper.make_node("MatMul", ["a", "w"], ["y"])], [numpy_helper.from_array(w, "w")])
    narrowed = {}
    for precision in VARIANTS:
        if precision == "int8":
            codes, scale = quantize_per_channel(w, 1)
            nodes = [helper.make_node("Cast", ["codes"], ["wide"], to=onnx.TensorProto.FLOAT),
                     helper.make_node("Mul", ["wide", "scale"], ["w"])]
            weights = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scale, "scale")]
        else:
            stored = w.astype(STORED[precision])
            kind = onnx.TensorProto.BFLOAT16 if precision == "bf16" else onnx.TensorProto.FLOAT16
            nodes = [helper.make_node("Cast", ["codes"], ["w"], to=onnx.TensorProto.FLOAT)]
            weights = [helper.make_tensor("codes", kind, (k, n), stored.view(np.uint16).tobytes(), raw=True)]
        narrowed[precision] = model(nodes + [helper.make_node("MatMul", ["a", "w"], ["y"])], weights)
    return exact, narrowed, {"a": rng.standard_normal((m, k)).astype(np.float32)}


def check_variants(out: Path, device: str, options: CudaOptions, shape: tuple[int, int, int], repeats: int) -> list[dict]:
    """One row per variant precision: its CU against onnxruntime on the narrowed product."""
    m, n, k = shape
    exact, narrowed, feed = variant_models(m, n, k)
    folder = out / f"{m}x{n}x{k}-variants"
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(exact, folder / "model.onnx")
    rows = [{"case": f"{m}x{n}x{k}-variant-{precision}", "m": m, "n": n, "k": k, "variant": precision}
            for precision in VARIANTS]
    try:
        decompose_model(folder / "model.onnx", folder / "cus", PartitionIntoCUs(4096, 50_000_000, 8))
        dag_path = folder / "dag.json"
        write_bytes_atomically(dag_path, json.dumps(build_dag(folder / "cus", dag_path), indent=2).encode())
        compile_cu_dir(target("cuda"), folder / "cus", folder / "cuda-bin", options, dag_path, variants=VARIANTS)
        dag = json.loads(dag_path.read_text())
        (cu,) = dag["cus"]
        runner = device_spec(device).open(dag, dag_path)
    except CortexError as e:
        return [{**row, "error": " ".join(str(e).split())[:300], "matches_onnxruntime": False} for row in rows]
    for row in rows:
        precision = row["variant"]
        if precision not in cu.get("variants", {}):
            row.update(error="compile-cuda built no such variant", matches_onnxruntime=False)
            continue
        record = variant_record(cu, precision)
        runner.load([record])
        inputs = {"a": runner.to_device(feed["a"])}
        got = runner.to_host(runner.run(record, inputs)["y"])
        session = ort.InferenceSession(narrowed[precision].SerializeToString(), providers=["CPUExecutionProvider"])
        want = session.run(None, feed)[0]
        largest, error = float(np.abs(want).max()), float(np.abs(got - want).max())
        synchronize = getattr(getattr(runner, "gpu", None), "synchronize", lambda: None)
        ms = median_ms(lambda: (runner.run(record, inputs), synchronize()), repeats)
        artifacts = record["artifacts"]["cuda"]
        weight_bytes = artifacts["weights"]["bytes"]
        row.update(max_error=error, largest_output=largest, relative_error=error / largest,
                   matches_onnxruntime=error <= RELATIVE_TOLERANCE * largest,
                   weight_bytes=weight_bytes, float32_bytes=4 * n * k, weight_share=weight_bytes / (4 * n * k),
                   kernels=[launch["kernel"] for launch in artifacts["launches"]],
                   launch_ms=ms, weight_gb_per_s=weight_bytes / ms / 1e6)
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="cuda-sim with small shapes (no GPU needed)")
    p.add_argument("--shapes", help=f"comma-separated MxNxK (default {GPU_SHAPES}; dry run {DRY_SHAPES})")
    p.add_argument("--variant-shape", help=f"MxNxK of the variants' product (default {GPU_VARIANT_SHAPE}; "
                   f"dry run {DRY_VARIANT_SHAPE})")
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
        variant_shape = tuple(int(d) for d in (args.variant_shape or (DRY_VARIANT_SHAPE if args.dry_run else GPU_VARIANT_SHAPE)).split("x"))
        if any(len(s) != 3 for s in shapes) or len(variant_shape) != 3:
            raise ValueError("--shapes, --variant-shape: expected MxNxK (--shapes comma-separated)")
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
    variants = check_variants(args.out, device, options, variant_shape, repeats)
    for row in variants:
        print(json.dumps(row), flush=True)
    document = {"gpu": gpu, "arch": arch, "device": device, "dry_run": args.dry_run,
                "compiler": f"nvcc {nvcc_version(find_nvcc())}" if compiler == "nvcc" else f"NVRTC {nvrtc_version()}",
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "relative_tolerance": RELATIVE_TOLERANCE, "repeats": repeats, "cases": cases, "variants": variants}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(args.output, (json.dumps(document, indent=2) + "\n").encode())
    print(f"wrote {args.output}")
    return 0 if all(c["matches_onnxruntime"] for c in cases + variants) else 1


if __name__ == "__main__":
    sys.exit(main())
