"""What `make gpu-check` times besides Cortex's own runs: torch eager on CUDA (through onnx2torch)
and the GEMM kernels alone, for their achieved TFLOP/s.

The model timings (`median_ms`) are wall-clock medians of whole runs: inputs go up and outputs come
back every run, for Cortex and torch alike. The kernel timings launch one CU's kernels on inputs
already on the device and wait for the GPU (`synchronize`), so they hold no copies.
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
from backends.registry import target
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
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
    """decompose -> build-dag -> compile-cuda, the compile into `cuda-bin-<precision>`, so several
    precisions of one model share its CUs (one dag.json each)."""
    cus = out / "cus"
    if not (cus / "manifest.json").is_file():
        decompose_model(Path(model_path), cus, PartitionIntoCUs(4096, 50_000_000, 8),
                        input_shapes=input_shapes or {}, dims=dims or {})
    dag_path = out / name
    write_bytes_atomically(dag_path, json.dumps(build_dag(cus, dag_path), indent=2).encode())
    compile_cu_dir(target("cuda"), cus, out / f"cuda-bin-{options.precision}", options, dag_path, jobs=jobs)
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


def kernel_tflops(out: Path, device: str, options: CudaOptions, size: int, repeats: int) -> dict:
    """One size x size x size MatMul CU at `options.precision`: median kernel time and TFLOP/s, and
    its largest error against float64 relative to the largest |y|."""
    path = gemm_model(out / "gemm.onnx", size, size, size)
    dag_path = compile_dag(path, out, options, name=f"dag-{options.precision}.json")
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
    return {"size": size, "precision": options.precision, "ms": ms, "tflops": 2 * size ** 3 / ms / 1e9,
            "relative_error": float(np.abs(y - want).max() / np.abs(want).max()),
            "tensor_core_kernels": sorted(record.get("precision", {}).get("tensor_cores", {}))}


def cu_times(dag_path: Path, device: str, repeats: int) -> dict[str, float]:
    """Median ms of each CU alone on `device`, its inputs (random, of the recorded shapes) already
    there; on a GPU it waits for the kernels. The hybrid threshold comes from comparing two devices."""
    model = cortex.load(dag_path, device=device, policy="strict")
    scheduler = model.scheduler
    rng = np.random.default_rng(2)
    times = {}
    for cu in scheduler.dag["cus"]:
        where = scheduler.devices[scheduler.placement[cu["id"]]]
        specs = scheduler.dag["tensors"]
        inputs = {}
        for name in cu["inputs"]:
            spec = specs[name]
            value = rng.standard_normal(spec["shape"]) if spec["dtype"].startswith("float") else \
                np.zeros(spec["shape"])
            inputs[name] = where.to_device(value.astype(spec["dtype"]))
        synchronize = getattr(getattr(where, "gpu", None), "synchronize", lambda: None)

        def run(cu=cu, where=where, inputs=inputs, synchronize=synchronize):
            where.run(cu, inputs)
            synchronize()
        try:
            times[cu["id"]] = median_ms(run, repeats)
        except Exception:  # noqa: BLE001, S112 -- random inputs may upset a CU (an index out of range): not timed
            continue
    return times


def crossover_flops(dag_paths: list[Path], gpu: str, cpu: str, repeats: int) -> dict:
    """The smallest CU flops from which the GPU runs each CU faster than the CPU device, over the
    CUs of all the models: the threshold for `--device hybrid` (CORTEX_HYBRID_GPU_MIN_FLOPS)."""
    points = []
    for dag_path in dag_paths:
        flops = {cu["id"]: int(cu.get("flops", 0)) for cu in json.loads(Path(dag_path).read_text())["cus"]}
        on_gpu, on_cpu = cu_times(dag_path, gpu, repeats), cu_times(dag_path, cpu, repeats)
        points += [(flops[c], on_gpu[c], on_cpu[c]) for c in on_gpu if c in on_cpu]
    points.sort()
    # The lowest threshold such that at most a tenth of the CUs above it are faster on the CPU.
    threshold = None
    for i, (f, _, _) in enumerate(points):
        above = points[i:]
        if sum(g > c for _, g, c in above) <= len(above) // 10:
            threshold = f
            break
    return {"cus": len(points), "crossover_flops": threshold, "cpu_device": cpu,
            "gpu_faster": sum(g < c for _, g, c in points)}
