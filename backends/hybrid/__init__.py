"""`--device hybrid`: each CU on the CPU (`wasm`) or the GPU (`cuda`) by its cost.

Small, latency-bound CUs stay on the CPU, where a launch and a copy across PCIe would cost more than
the work; heavy contractions go to the GPU. The cost is the CU's `flops` in dag.json: a CU with at
least `gpu_min_flops` runs on the GPU (if it has a cuda artifact), the rest on the CPU. The CPU
side is wasm for a CU compiled for it; without a wasm artifact, or without wasmtime installed (a
GPU machine that carries only what the CUDA path needs), it is the `onnxruntime` device, which runs
any CU from its cu.onnx. The scheduler moves a tensor between host and GPU only where the placement
changes, and its trace names, per CU, the device it ran on and the bytes it took from the other
device (`bytes_from_other_devices`).

The threshold, first found wins: `CORTEX_HYBRID_GPU_MIN_FLOPS` when set (an override); else the
crossover `cortex calibrate --hybrid` measured on this same GPU device and recorded in dag.json
(`hybrid.crossover_flops`; null there means the GPU won on no CU, so every CU stays on the CPU);
else `DEFAULT_GPU_MIN_FLOPS`, an estimate of where one CU's GPU run (a launch per kernel, about 5-10
us each, and its inputs copied up at a border) starts to beat the wasm kernels at a few GFLOP/s on
one core, about 20 us of CPU work. A record measured on cuda-sim places only `hybrid-sim`, one
measured on a GPU only `hybrid`: a simulator's timings say nothing about a GPU.

`hybrid-sim` places the same way with cuda-sim in place of the GPU, so the placement, the border
copies and the outputs can be tested on a machine without one.
"""

from __future__ import annotations

import os
from pathlib import Path

from backends.cuda.device import gpu_unavailable
from backends.registry import DeviceSpec, device, devices, register_device
from ir.errors import CortexError

DEFAULT_GPU_MIN_FLOPS = 100_000
THRESHOLD_VARIABLE = "CORTEX_HYBRID_GPU_MIN_FLOPS"


def gpu_min_flops(dag: dict | None = None, gpu: str = "cuda") -> int | None:
    """The flops from which a CU goes to `gpu`; None: no CU does (a recorded crossover that found none)."""
    text = os.environ.get(THRESHOLD_VARIABLE)
    if text is None:
        record = (dag or {}).get("hybrid")
        if record and record["device"] == gpu:
            return record["crossover_flops"]
        return DEFAULT_GPU_MIN_FLOPS
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise CortexError(f"{THRESHOLD_VARIABLE} must be a whole number of flops, at least 0 (got {text!r})")
    return value


def cpu_device(cu: dict) -> str:
    """The CPU side for one CU: wasm where it was compiled for it (and wasmtime is here), else onnxruntime."""
    return "wasm" if "wasm" in devices() and "wasm" in cu.get("artifacts", {}) else "onnxruntime"


def placer(gpu: str, dag: dict | None = None):
    """The placement rule for one GPU device name and dag.json: (cu record) -> the CPU device or `gpu`."""
    threshold = gpu_min_flops(dag, gpu)

    def place(cu: dict) -> str:
        if "cuda" not in cu.get("artifacts", {}) or threshold is None:
            return cpu_device(cu)
        return gpu if int(cu.get("flops", 0)) >= threshold else cpu_device(cu)
    return place


def _open_on_cpu(dag: dict, dag_path: Path):
    """A dag.json without CUs still needs a device to name: the CPU one."""
    return device("wasm").open(dag, dag_path)


register_device(DeviceSpec(name="hybrid", artifact=None, open=_open_on_cpu, unavailable=gpu_unavailable,
                           place=lambda dag: placer("cuda", dag),
                           description="each CU on wasm or on the GPU (cuda) by its flops"))
register_device(DeviceSpec(name="hybrid-sim", artifact=None, open=_open_on_cpu, place=lambda dag: placer("cuda-sim", dag),
                           description="hybrid with cuda-sim standing in for the GPU"))
