"""`cortex calibrate --hybrid`: the flops from which a CU runs faster on the GPU than on the CPU.

One feed runs through the model once (strictly, on the hybrid device as it places now) to give
every CU the inputs it really sees. Then each CU that has a cuda artifact and ran is timed alone on
both sides, as the median wall time of `repeats` runs after one warm-up:
- the CPU side (`backends.hybrid.cpu_device`: wasm, or onnxruntime without a wasm build) on host
  arrays;
- the GPU side (cuda, or cuda-sim for `hybrid-sim`) as if the CU were placed there alone, between
  CPU neighbours: its inputs copied up, its kernels run, its outputs copied back (the copy back
  waits for the kernels). A CU between GPU neighbours would pay less, so this errs on the CPU side.

The crossover is the smallest flops from which at most a tenth of the timed CUs at or above it
run faster on the CPU (`crossover_threshold`); none when even the heaviest CU runs faster there.
dag.json records it with every timing as its top-level `hybrid` record, rewritten atomically and
checked against the schema first; `--device hybrid` (or `hybrid-sim`, for a record measured on
cuda-sim) then places by it unless CORTEX_HYBRID_GPU_MIN_FLOPS overrides it.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path

import numpy as np

from backends.hybrid import cpu_device
from backends.limits import SandboxLimits
from backends.registry import Device
from backends.registry import device as device_spec
from cortex.dag import validate_dag
from cortex.runtime.loader import CompiledModel
from cortex.tools.calibrate import ExactRun
from ir.errors import CortexError
from ir.fs import write_bytes_atomically

GPU_OF = {"hybrid": "cuda", "hybrid-sim": "cuda-sim"}
CPU_SLOWER_SHARE = 10        # above the crossover, at most 1 CU in this many may run faster on the CPU


def crossover_threshold(points: list[tuple[int, float, float]]) -> int | None:
    """(flops, gpu_ms, cpu_ms) per CU -> the lowest flops such that at most a tenth of the CUs at or
    above it are faster on the CPU; None when there is none (the heaviest CU is faster there)."""
    points = sorted(points)
    for i, (flops, _, _) in enumerate(points):
        above = points[i:]
        if sum(gpu > cpu for _, gpu, cpu in above) <= len(above) // CPU_SLOWER_SHARE:
            return flops
    return None


def median_ms(run, repeats: int) -> float:
    run()                        # the warm-up: first-call allocations, native code, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def alone_on(device: Device, cu: dict, env: dict):
    """One run of `cu` on `device` from host inputs to host outputs, the copies at its borders included."""
    def run():
        results = device.run(cu, {name: device.to_device(env[name]) for name in cu["inputs"]})
        for tensor in results.values():
            device.to_host(tensor)
    return run


def open_devices(dag: dict, dag_path: Path, placement: dict[str, str]) -> dict[str, Device]:
    """Each device named in `placement` (CU id -> device), opened and loaded with its CUs."""
    opened = {}
    for name in dict.fromkeys(placement.values()):
        ids = [cu_id for cu_id in dag["order"] if placement[cu_id] == name]
        cus = [cu for cu in dag["cus"] if cu["id"] in ids]
        part, spec = {**dag, "cus": cus, "order": ids}, device_spec(name)
        opened[name] = spec.open(part, dag_path, SandboxLimits()) if spec.sandboxed else spec.open(part, dag_path)
        opened[name].load(cus)
    return opened


def measure_crossover(dag_path: Path, device: str, feed: dict[str, np.ndarray], repeats: int = 5) -> dict:
    """The `hybrid` record of dag.json for `device` (hybrid or hybrid-sim), measured on `feed`."""
    if device not in GPU_OF:
        raise CortexError(f"--hybrid measures where --device hybrid or hybrid-sim places CUs; got --device {device}")
    if repeats < 1:
        raise CortexError(f"--repeats must be at least 1 (got {repeats})")
    dag_path = Path(dag_path)
    model = CompiledModel(dag_path, device, policy="strict")
    dag, gpu = model.dag, GPU_OF[device]
    if not any("cuda" in cu.get("artifacts", {}) for cu in dag["cus"]):
        raise CortexError(f"{dag_path}: no CU has a cuda artifact, so nothing can run on {gpu}; "
                          f"run 'cortex compile-cuda --dag {dag_path}' first")
    env, ran = ExactRun(model).forward(feed)
    timed = [cu for cu in dag["cus"] if cu["id"] in ran and "cuda" in cu.get("artifacts", {})]
    on_gpu = open_devices({**dag, "order": [cu["id"] for cu in timed]}, dag_path, {cu["id"]: gpu for cu in timed})
    on_cpu = open_devices({**dag, "order": [cu["id"] for cu in timed]}, dag_path,
                          {cu["id"]: cpu_device(cu) for cu in timed})
    cus = {}
    for cu in timed:
        cpu = cpu_device(cu)
        cus[cu["id"]] = {"flops": int(cu.get("flops", 0)), "cpu_device": cpu,
                         "cpu_ms": median_ms(alone_on(on_cpu[cpu], cu, env), repeats),
                         "gpu_ms": median_ms(alone_on(on_gpu[gpu], cu, env), repeats)}
    record = {"device": gpu, "crossover_flops": crossover_threshold(
                  [(t["flops"], t["gpu_ms"], t["cpu_ms"]) for t in cus.values()]),
              "measured_on": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "repeats": repeats, "cus": cus}
    threshold = record["crossover_flops"]
    for cu in timed:
        on_the_gpu = threshold is not None and cus[cu["id"]]["flops"] >= threshold
        cus[cu["id"]]["placement"] = gpu if on_the_gpu else cpu_device(cu)
    return record


def record_crossover(dag_path: Path, device: str, feed: dict[str, np.ndarray], repeats: int = 5) -> dict:
    """Measure the crossover and write it into dag.json (atomically, schema-checked first)."""
    dag_path = Path(dag_path)
    record = measure_crossover(dag_path, device, feed, repeats)
    dag = json.loads(dag_path.read_text())
    dag["hybrid"] = record
    validate_dag(dag)
    write_bytes_atomically(dag_path, (json.dumps(dag, indent=2) + "\n").encode())
    return record
