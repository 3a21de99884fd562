"""`cortex.load(dag.json, device=...)`: a compiled model that runs its CUs in dag.json's order.

Inputs are checked against dag.json (names, dtypes, shapes) with one clear error; tensors move from
CU to CU as numpy arrays (views of the producing module's memory until the next run); outputs are
returned as arrays the caller owns. `trace` records each CU's wall time and the bytes it moved.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from cortex.dag import read_dag
from ir.errors import CortexError

DEVICES = ("wasm", "cuda", "cuda-sim")


class CompiledModel:
    def __init__(self, dag_path: Path, device: str = "wasm"):
        self.path = Path(dag_path)
        self.dag = read_dag(self.path)
        if device not in DEVICES:
            raise CortexError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
        if device == "wasm":
            from cortex.runtime.wasm import WasmDevice
            self.device = WasmDevice(self.dag, self.path)
        else:
            from backends.cuda.runtime_device import CudaGpuDevice, CudaSimDevice
            self.device = (CudaSimDevice if device == "cuda-sim" else CudaGpuDevice)(self.dag, self.path)
        self._cus = {cu["id"]: cu for cu in self.dag["cus"]}
        self.trace: list[dict] = []

    @property
    def inputs(self) -> list[dict]:
        return list(self.dag["inputs"])

    @property
    def outputs(self) -> list[dict]:
        return list(self.dag["outputs"])

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        env = self._checked_inputs(feeds)
        self.trace = []
        for cu_id in self.dag["order"]:
            cu = self._cus[cu_id]
            start = time.perf_counter()
            results = self.device.run_cu(cu, env)
            seconds = time.perf_counter() - start
            env.update(results)
            self.trace.append({"cu": cu_id, "op_types": cu.get("op_types", []), "start": start, "seconds": seconds,
                               "bytes_in": int(sum(env[n].nbytes for n in cu["inputs"])),
                               "bytes_out": int(sum(r.nbytes for r in results.values()))})
        return {spec["name"]: np.array(env[spec["name"]]) for spec in self.dag["outputs"]}

    def _checked_inputs(self, feeds: dict) -> dict[str, np.ndarray]:
        if not isinstance(feeds, dict):
            raise CortexError("inputs must be a dict of name -> numpy array")
        expected = {spec["name"]: spec for spec in self.dag["inputs"]}
        unknown = sorted(set(feeds) - set(expected))
        if unknown:
            raise CortexError(f"unknown input {', '.join(map(repr, unknown))}: the model's inputs are "
                              f"{', '.join(map(repr, expected))}")
        env = {}
        for name, spec in expected.items():
            if name not in feeds:
                raise CortexError(f"missing input {name!r} ({spec['dtype']}{spec['shape']})")
            value = np.asarray(feeds[name])
            if value.dtype != np.dtype(spec["dtype"]):
                raise CortexError(f"input {name!r} has dtype {value.dtype}, the model expects {spec['dtype']}")
            if list(value.shape) != list(spec["shape"]):
                raise CortexError(f"input {name!r} has shape {list(value.shape)}, the model expects {spec['shape']}")
            env[name] = value
        return env

    def trace_document(self) -> dict:
        """Per-CU timings and bytes; `traceEvents` opens in chrome://tracing or Perfetto."""
        t0 = self.trace[0]["start"] if self.trace else 0.0
        return {
            "device": self.device.name,
            "dag": str(self.path),
            "total_seconds": sum(t["seconds"] for t in self.trace),
            "cus": [{k: v for k, v in t.items() if k != "start"} for t in self.trace],
            "traceEvents": [{"name": t["cu"], "cat": ",".join(t["op_types"]), "ph": "X", "pid": 0, "tid": 0,
                             "ts": (t["start"] - t0) * 1e6, "dur": t["seconds"] * 1e6,
                             "args": {"bytes_in": t["bytes_in"], "bytes_out": t["bytes_out"]}} for t in self.trace],
        }


def load(dag_path, device: str = "wasm") -> CompiledModel:
    return CompiledModel(Path(dag_path), device)
