"""`cortex.load(dag.json, device=...)`: a compiled model, ready to `run({name: array})`.

The dag.json is checked before anything is loaded (`cortex.dag.read_dag`: schema, data flow,
memory plans, artifact paths confined to its folder); the device comes from the registry by name;
the scheduler decides what runs, and where: fallback CUs on their runtime's device. Inputs are checked against dag.json (names, dtypes, shapes) with
one clear error; outputs are arrays the caller owns. `trace` records each CU's wall time, the bytes
it read and wrote, the memory it holds, and the device that ran it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from backends.registry import device as device_spec
from backends.registry import devices
from cortex.dag import read_dag
from cortex.runtime.scheduler import SequentialScheduler
from ir.errors import CortexError


def device_names() -> list[str]:
    return list(devices())


class CompiledModel:
    def __init__(self, dag_path: Path, device: str = "wasm"):
        self.path = Path(dag_path)
        self.device_name = device_spec(device).name
        self.dag = read_dag(self.path)
        self.scheduler = SequentialScheduler(self.dag, self.path, device)
        self.scheduler.load()
        # The model's device (None when every CU runs on a fallback device).
        self.device = self.scheduler.devices.get(device)
        self.trace: list[dict] = []
        self.skipped_cus: list[dict] = []     # [{"cu", "reason"}] of the latest run (inactive branches)

    @property
    def inputs(self) -> list[dict]:
        return list(self.dag["inputs"])

    @property
    def outputs(self) -> list[dict]:
        return list(self.dag["outputs"])

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        outputs, self.trace = self.scheduler.run(self._checked_inputs(feeds))
        self.skipped_cus = list(self.scheduler.last_skipped)
        return outputs

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
            "device": self.device_name,
            "dag": str(self.path),
            "cus_by_device": {name: sum(1 for t in self.trace if t["device"] == name)
                              for name in dict.fromkeys(t["device"] for t in self.trace)},
            "total_seconds": sum(t["seconds"] for t in self.trace),
            "activated_cus": [t["cu"] for t in self.trace],
            "skipped_cus": list(self.skipped_cus),
            "cus": [{k: v for k, v in t.items() if k != "start"} for t in self.trace],
            "traceEvents": [{"name": t["cu"], "cat": ",".join(t["op_types"]), "ph": "X", "pid": 0, "tid": 0,
                             "ts": (t["start"] - t0) * 1e6, "dur": t["seconds"] * 1e6,
                             "args": {"device": t["device"], "bytes_in": t["bytes_in"],
                                      "bytes_out": t["bytes_out"]}} for t in self.trace],
        }


def load(dag_path, device: str = "wasm") -> CompiledModel:
    return CompiledModel(Path(dag_path), device)
