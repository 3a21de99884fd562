"""The `cuda` and `cuda-sim` devices of the runtime loader (`cortex.load`, `cortex run --device`).

Both read each CU's `artifacts.cuda` record from dag.json, refuse files whose sha256 differs, and
run the CU's launch list (`CuProgram`). `cuda-sim` compiles the `.cu` for the host and runs it on
the CPU with numpy arrays as device memory. `cuda` loads the cubin for the GPU's architecture (or
JITs the PTX) and keeps every tensor on the device: model inputs are uploaded once, CU outputs are
device buffers handed to the next CU, and only the model's outputs are copied back.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backends.cuda.program import CuProgram
from ir.errors import CortexError


def _records(dag: dict, dag_path: Path) -> dict[str, tuple[dict, Path]]:
    records = {}
    for cu in dag["cus"]:
        record = cu.get("artifacts", {}).get("cuda")
        if record is None:
            raise CortexError(f"{dag_path}: {cu['id']} has no cuda artifact; run 'cortex compile-cuda --dag {dag_path}' first")
        folder = dag_path.parent / record["folder"]
        entries = [record["source"], record["weights"], record["ptx"], *record["cubins"].values()]
        for entry in filter(None, entries):   # a kernel-free CU has no source, PTX or cubins
            path = folder / entry["file"]
            if not path.is_file():
                raise CortexError(f"{path}: missing ({cu['id']} in {dag_path}); run 'cortex compile-cuda' again")
            if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
                raise CortexError(f"{path}: sha256 differs from {dag_path} (modified or stale); run 'cortex compile-cuda' again")
        records[cu["id"]] = (record, folder)
    return records


class CudaSimDevice:
    name = "cuda-sim"

    def __init__(self, dag: dict, dag_path: Path, *, seed: int = 0, host_threads: int | None = None):
        from backends.cuda.sim import build
        threads = host_threads or int(os.environ.get("CORTEX_SIM_THREADS", 0)) or (os.cpu_count() or 1)
        records = _records(dag, Path(dag_path))
        # Host compilation dominates loading: build every CU's library at once (g++ processes).
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(lambda rf: build(rf[1] / rf[0]["source"]["file"]),
                          [rf for rf in records.values() if rf[0].get("module", True)]))
        self.programs = {cu_id: CuProgram(None, record, folder, seed=seed, host_threads=threads)
                         for cu_id, (record, folder) in records.items()}

    def run_cu(self, cu: dict, env: dict) -> dict[str, np.ndarray]:
        return self.programs[cu["id"]].run({name: env[name] for name in cu["inputs"]})


class CudaGpuDevice:
    name = "cuda"

    def __init__(self, dag: dict, dag_path: Path):
        from backends.cuda.device import CudaDevice
        self.gpu = CudaDevice()
        self.model_outputs = {spec["name"]: spec for spec in dag["outputs"]}
        self.first_cu = dag["order"][0] if dag["order"] else None
        self._uploaded: dict[int, tuple[np.ndarray, object]] = {}   # this run's host inputs, uploaded once
        self.programs = {cu_id: CuProgram(self.gpu, record, folder)
                         for cu_id, (record, folder) in _records(dag, Path(dag_path)).items()}

    def run_cu(self, cu: dict, env: dict) -> dict:
        program = self.programs[cu["id"]]
        if cu["id"] == self.first_cu:
            self._uploaded = {}
        feeds = {}
        for name in cu["inputs"]:
            value = env[name]
            if isinstance(value, np.ndarray):
                if id(value) not in self._uploaded:
                    self._uploaded[id(value)] = (value, self.gpu.upload(value))
                value = self._uploaded[id(value)][1]
            feeds[name] = value
        results = program.run(feeds)
        out = {}
        for name, buffer in results.items():
            spec = next(p for p in program.params if p["name"] == name)
            out[name] = self.gpu.download(buffer, spec["shape"], spec["dtype"]) if name in self.model_outputs else buffer
        return out
