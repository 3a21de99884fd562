"""`--device hybrid`: each CU on the CPU (`wasm`) or the GPU (`cuda`) by its cost.

Small, latency-bound CUs stay on the CPU, where a launch and a copy across PCIe would cost more than
the work; heavy contractions go to the GPU. The cost is the CU's `flops` in dag.json: a CU with at
least `gpu_min_flops` runs on the GPU (if it has a cuda artifact), the rest on the CPU. The CPU
side is wasm for a CU compiled for it; without a wasm artifact, or without wasmtime installed (a
GPU machine that carries only what the CUDA path needs), it is the `onnxruntime` device, which runs
any CU from its cu.onnx. The scheduler moves a tensor between host and GPU only where the placement
changes, and its trace names, per CU, the device it ran on and the bytes it took from the other
device (`bytes_from_other_devices`).

The threshold: `CORTEX_HYBRID_GPU_MIN_FLOPS` when set, else `DEFAULT_GPU_MIN_FLOPS`, an estimate (not
yet measured on a GPU) of where one CU's GPU run (a launch per kernel, about 5-10 us each, and its
inputs copied up at a border) starts to beat the wasm kernels at a few GFLOP/s on one core, about
20 us of CPU work; `make gpu-check` measures the crossover on the GPU at hand and reports it as `hybrid.crossover_flops`.

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


def gpu_min_flops() -> int:
    text = os.environ.get(THRESHOLD_VARIABLE)
    if text is None:
        return DEFAULT_GPU_MIN_FLOPS
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise CortexError(f"{THRESHOLD_VARIABLE} must be a whole number of flops, at least 0 (got {text!r})")
    return value


def placer(gpu: str):
    """The placement rule for one GPU device name: (cu record) -> the CPU device or `gpu`."""
    threshold = gpu_min_flops()
    cpu_side = "wasm" if "wasm" in devices() else "onnxruntime"

    def place(cu: dict) -> str:
        artifacts = cu.get("artifacts", {})
        cpu = cpu_side if cpu_side in artifacts else "onnxruntime"
        if "cuda" not in artifacts:
            return cpu
        return gpu if int(cu.get("flops", 0)) >= threshold else cpu
    return place


def _open_on_cpu(dag: dict, dag_path: Path):
    """A dag.json without CUs still needs a device to name: the CPU one."""
    return device("wasm").open(dag, dag_path)


register_device(DeviceSpec(name="hybrid", artifact=None, open=_open_on_cpu, unavailable=gpu_unavailable,
                           place=lambda: placer("cuda"),
                           description="each CU on wasm or on the GPU (cuda) by its flops"))
register_device(DeviceSpec(name="hybrid-sim", artifact=None, open=_open_on_cpu, place=lambda: placer("cuda-sim"),
                           description="hybrid with cuda-sim standing in for the GPU"))
