"""The `cuda` and `cuda-sim` devices.

Both read each CU's `artifacts.cuda` record from dag.json, refuse files whose sha256 differs, and
run the CU's launch list (`CuRunner`). `cuda-sim` compiles the `.cu` for the host and runs it on
the CPU with numpy arrays as device memory. `cuda` loads the cubin for the GPU's architecture (or
JITs the PTX) and keeps every tensor on the device: model inputs are uploaded once (`to_device`),
CU outputs are device buffers handed to the next CU, and only what the caller asks for is copied
back (`to_host`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.cuda.content_addressed import file_entries
from backends.cuda.driver import CudaDevice, CudaDeviceError, DeviceBuffer, open_driver
from backends.cuda.runner import CuRunner
from backends.cuda.sim import build as build_for_host
from backends.registry import HostTensors
from ir.bounds import real_part
from ir.errors import CortexError
from ir.fs import confined_path, read_artifact


def _record(cu: dict, dag_path: Path) -> tuple[dict, Path]:
    """The CU's record and its folder, every file in it checked against its sha256 (the weights
    when the runner reads them)."""
    record = cu["artifacts"]["cuda"]     # _check_artifacts made sure, when the device was opened
    folder = confined_path(dag_path.parent, record["folder"])    # read_dag checked it stays inside
    weights = file_entries({**record, "source": None, "ptx": None, "cubins": {}})
    for entry in file_entries(record):   # a kernel-free CU has no source, PTX or cubins
        if entry not in weights:
            read_artifact(folder / entry["file"], entry["sha256"], f"{cu['id']} in {dag_path}",
                          "run 'cortex compile-cuda' again")
    return record, folder


def _check_artifacts(dag: dict, dag_path: Path) -> None:
    for cu in dag["cus"]:
        if "cuda" not in cu.get("artifacts", {}):
            raise CortexError(f"{dag_path}: {cu['id']} has no cuda artifact; run 'cortex compile-cuda --dag {dag_path}' first")


class CudaSimDevice(HostTensors):
    name = "cuda-sim"

    def __init__(self, dag: dict, dag_path: Path, *, seed: int = 0, host_threads: int | None = None):
        _check_artifacts(dag, Path(dag_path))
        self.dag_path = Path(dag_path)
        self.seed = seed
        self.threads = host_threads or int(os.environ.get("CORTEX_SIM_THREADS", 0)) or (os.cpu_count() or 1)
        self.runners: dict[str, CuRunner] = {}

    def load(self, cus: list[dict]) -> None:
        records = {cu["id"]: _record(cu, self.dag_path) for cu in cus if cu["id"] not in self.runners}
        # Host compilation dominates loading: build every CU's library at once (g++ processes).
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(lambda rf: build_for_host(rf[1] / rf[0]["source"]["file"]),
                          [rf for rf in records.values() if rf[0].get("module", True)]))
        for cu_id, (record, folder) in records.items():
            self.runners[cu_id] = CuRunner(None, record, folder, seed=self.seed, host_threads=self.threads,
                                           owner=f"{cu_id} in {self.dag_path}")

    def run(self, cu: dict, inputs: dict) -> dict[str, np.ndarray]:
        runner = self.runners[cu["id"]]
        outputs = runner.run(inputs)
        for name, (axis, length) in runner.output_lengths().items():
            outputs[name] = real_part(outputs[name], axis, length)
        return outputs

    def resident_bytes(self, cu_id: str) -> int:
        runner = self.runners.get(cu_id)
        return runner.resident_bytes if runner else 0

    def footprint(self, cu: dict) -> int:
        return cuda_footprint(cu)

    def unload(self, cu_id: str) -> int:
        runner = self.runners.pop(cu_id, None)
        return runner.resident_bytes if runner else 0


@dataclass(frozen=True)
class GpuTensor:
    """A tensor in GPU memory: the buffer, and what the host needs to copy it back."""
    buffer: DeviceBuffer
    shape: tuple[int, ...]
    dtype: str
    real: tuple[int, int] | None = None    # a bounded tensor's (axis, real length), ir/bounds.py


class CudaGpuDevice:
    name = "cuda"

    def __init__(self, dag: dict, dag_path: Path):
        _check_artifacts(dag, Path(dag_path))
        self.dag_path = Path(dag_path)
        self.gpu = CudaDevice()
        self.runners: dict[str, CuRunner] = {}

    def load(self, cus: list[dict]) -> None:
        for cu in cus:
            if cu["id"] not in self.runners:
                record, folder = _record(cu, self.dag_path)
                self.runners[cu["id"]] = CuRunner(self.gpu, record, folder, owner=f"{cu['id']} in {self.dag_path}")

    def run(self, cu: dict, inputs: dict[str, GpuTensor]) -> dict[str, GpuTensor]:
        runner = self.runners[cu["id"]]
        # A bounded input is padded on the host into the CU's own buffer (it is small: a selection).
        buffers = runner.run({name: self.to_host(tensor) if name in runner.bounds else tensor.buffer
                              for name, tensor in inputs.items()})
        specs = {p["name"]: p for p in runner.params}
        lengths = runner.output_lengths()
        return {name: GpuTensor(buffer, tuple(specs[name]["shape"]), specs[name]["dtype"], lengths.get(name))
                for name, buffer in buffers.items()}

    def to_device(self, array: np.ndarray) -> GpuTensor:
        array = np.ascontiguousarray(array)
        return GpuTensor(self.gpu.upload(array), array.shape, array.dtype.name)

    def to_host(self, tensor: GpuTensor) -> np.ndarray:
        array = self.gpu.download(tensor.buffer, tensor.shape, tensor.dtype)
        return array if tensor.real is None else np.array(real_part(array, *tensor.real))

    def resident_bytes(self, cu_id: str) -> int:
        runner = self.runners.get(cu_id)
        return runner.resident_bytes if runner else 0

    def footprint(self, cu: dict) -> int:
        return cuda_footprint(cu)

    def unload(self, cu_id: str) -> int:
        runner = self.runners.pop(cu_id, None)
        return runner.resident_bytes if runner else 0


def cuda_footprint(cu: dict) -> int:
    """The weights blob, the scratch and the output buffers the record names: a runner's `resident_bytes`."""
    record = cu["artifacts"]["cuda"]
    if not record.get("module", True):
        return 0
    outputs = sum(int(p["bytes"]) for p in record.get("params", []) if p.get("kind") == "output")
    return int(record.get("weights", {}).get("bytes", 0)) + int(record.get("scratch_bytes", 0)) + outputs


def gpu_unavailable() -> str | None:
    """Why `--device cuda` cannot run in this process, or None."""
    try:
        open_driver()
    except CudaDeviceError as e:
        return str(e)
    return None
