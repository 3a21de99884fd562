"""What `make gpu-check` times besides Cortex's own runs: torch eager on CUDA (through onnx2torch)
and the GEMM kernels alone, for their achieved TFLOP/s.

The model timings (`median_ms`) are wall-clock medians of whole runs: inputs go up and outputs come
back every run, for Cortex and torch alike. The kernel timings launch one CU's kernels on inputs
already on the device and wait for the GPU (`synchronize`), so they hold no copies. The hybrid
crossover is `cortex calibrate --hybrid`'s measurement (cortex/tools/crossover.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import cortex
from backends.cuda.build import CudaOptions
from backends.cuda.wmma_tiled import tiling_for
from backends.registry import target
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from cortex.tools.crossover import crossover_threshold, record_crossover
from ir.errors import CortexError
from ir.fs import write_bytes_atomically
from passes.partition import PartitionIntoCUs


def median_ms(fn, repeats: int) -> float:
    """Wall-clock median after one warm-up run (module loads, JIT, allocations)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _without_torchvision() -> None:
    """onnx2torch imports torchvision only for its NMS and RoiAlign converters, which none of the
    timed models uses; a torchvision wheel is tied to one torch build, so none travels with the
    check, and where it is missing those two names stand in (calling them fails)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        ops = types.ModuleType("torchvision.ops")

        def missing(*_, **__):
            raise ImportError("torchvision is not installed")
        ops.nms = ops.roi_align = ops.box_convert = missing
        stub = types.ModuleType("torchvision")
        stub.ops = ops
        sys.modules.setdefault("torchvision", stub)
        sys.modules.setdefault("torchvision.ops", ops)


def torch_cuda_timer(case, repeats: int) -> tuple[str, float | None]:
    """(name, median ms) of torch eager on CUDA through onnx2torch; (why not, None) where it cannot."""
    try:
        import torch
        _without_torchvision()
        import onnx2torch
    except ImportError as e:
        return f"none ({e.name} is not installed: make gpu-wheels)", None
    if not torch.cuda.is_available():
        return "none (torch has no CUDA here)", None
    try:
        module = onnx2torch.convert(str(case.path)).cuda().eval()
    except Exception as e:   # onnx2torch lacks converters for some ops: say which, keep going
        return f"none (onnx2torch: {' '.join(str(e).split())[:120]})", None
    feeds = [torch.from_numpy(np.asarray(v)) for v in case.inputs.values()]

    def run():
        with torch.no_grad():
            outputs = module(*[f.cuda() for f in feeds])
        for o in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
            o.cpu()
    return "torch eager CUDA (onnx2torch)", median_ms(run, repeats)


def compile_dag(model_path: Path, out: Path, options: CudaOptions, input_shapes=None, dims=None,
                jobs: int = 16, name: str = "dag.json") -> Path:
    """decompose -> build-dag -> compile-cuda, the compile into `cuda-bin-<precision>[-<tile>]`, so
    several precisions (and tensor-core tilings) of one model share its CUs (one dag.json each)."""
    cus = out / "cus"
    if not (cus / "manifest.json").is_file():
        decompose_model(Path(model_path), cus, PartitionIntoCUs(4096, 50_000_000, 8),
                        input_shapes=input_shapes or {}, dims=dims or {})
    dag_path = out / name
    write_bytes_atomically(dag_path, json.dumps(build_dag(cus, dag_path), indent=2).encode())
    tile = "" if options.tensor_core_tile == "auto" else f"-{options.tensor_core_tile}"
    compile_cu_dir(target("cuda"), cus, out / f"cuda-bin-{options.precision}{tile}", options, dag_path, jobs=jobs)
    return dag_path


def gemm_model(path: Path, m: int, n: int, k: int) -> Path:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def tensor_core_kernel(size: int, tile: str) -> str:
    """What the tensor-core kernel of a size x size output is: its block tiling, or the single tile."""
    if tile == "single":
        return "single 16x16 tile per warp, 1 stage"
    return f"{tiling_for(size, size, 1, tile).name} block"


def kernel_tflops(out: Path, device: str, options: CudaOptions, size: int, repeats: int) -> dict:
    """One size x size x size MatMul CU at `options.precision` (on `options.tensor_core_tile`): median
    kernel time and TFLOP/s, and its largest error against float64 relative to the largest |y|."""
    path = gemm_model(out / "gemm.onnx", size, size, size)
    tile = "" if options.tensor_core_tile == "auto" else f"-{options.tensor_core_tile}"
    dag_path = compile_dag(path, out, options, name=f"dag-{options.precision}{tile}.json")
    model = cortex.load(dag_path, device=device, policy="strict")
    scheduler = model.scheduler
    cu = scheduler.dag["cus"][0]
    gpu = scheduler.devices[scheduler.placement[cu["id"]]]
    x = np.random.default_rng(1).standard_normal((size, size)).astype(np.float32)
    inputs = {cu["inputs"][0]: gpu.to_device(x)}
    synchronize = getattr(getattr(gpu, "gpu", None), "synchronize", lambda: None)

    def run():
        gpu.run(cu, inputs)
        synchronize()
    ms = median_ms(run, repeats)
    y = gpu.to_host(gpu.run(cu, inputs)[cu["outputs"][0]])
    w = numpy_helper.to_array(onnx.load(path).graph.initializer[0]).astype(np.float64)
    want = x.astype(np.float64) @ w
    record = cu["artifacts"]["cuda"]
    kernel = "exact" if options.precision == "exact" else tensor_core_kernel(size, options.tensor_core_tile)
    return {"size": size, "precision": options.precision, "kernel": kernel, "ms": ms, "tflops": 2 * size ** 3 / ms / 1e9,
            "relative_error": float(np.abs(y - want).max() / np.abs(want).max()),
            "tensor_core_kernels": sorted(record.get("precision", {}).get("tensor_cores", {}))}


def crossover_flops(runs: list[tuple[Path, dict]], hybrid: str, repeats: int) -> dict:
    """The crossover for `--device hybrid`, by the path `cortex calibrate --hybrid` takes: each model's
    CUs timed on its own feed, alone on the CPU and on the GPU (copies at the CU's borders included),
    its crossover recorded in its dag.json; then the same rule over the CUs of all the models."""
    points, cpu_devices, models = [], set(), {}
    for dag_path, feed in runs:
        try:
            record = record_crossover(dag_path, hybrid, feed, repeats)
        except CortexError as e:
            models[Path(dag_path).parent.name] = {"error": " ".join(str(e).split())[:300]}
            continue
        models[Path(dag_path).parent.name] = {"crossover_flops": record["crossover_flops"], "cus": len(record["cus"])}
        for timing in record["cus"].values():
            points.append((timing["flops"], timing["gpu_ms"], timing["cpu_ms"]))
            cpu_devices.add(timing["cpu_device"])
    return {"cus": len(points), "crossover_flops": crossover_threshold(points),
            "cpu_device": ", ".join(sorted(cpu_devices)) or "the CPU",
            "gpu_faster": sum(gpu < cpu for _, gpu, cpu in points), "models": models}
