"""The scheduler decides which CUs run, in what order and where; a Device only runs what it is
handed. Today it runs every CU, one at a time, in dag.json's topological order, except the
branch CUs of a decomposed If whose condition picks the other branch (`activation.py`): those are
skipped, with the reason, in `last_skipped`.

Where: each CU on the device its record asks for (`runs_on`: a fallback CU's runtime, from
`cortex decompose --fallback`), the others on the model's device. Each device comes from the
registry by name and is opened on the CUs it runs. Tensors cross between devices only at those
borders, through the producer's `to_host` and the reader's `to_device`, once per tensor and device
in a request; model inputs go to each device that reads them.

The later runtime features live here: activation of conditional CUs, the result cache, memory
tiers with prefetch, threads and remote executors all change which CU runs next, never how a CU
runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from backends.registry import Device
from backends.registry import device as device_spec
from cortex.runtime.activation import Branches

HOST = None   # where a model input lives before any device reads it


class SequentialScheduler:
    def __init__(self, dag: dict, dag_path: Path, device: str):
        self.dag = dag
        self.cus = {cu["id"]: cu for cu in dag["cus"]}
        self.tensor_bytes = {name: t["bytes"] for name, t in dag["tensors"].items()}
        # What a trace entry says of each CU that no run changes, computed once, not per request.
        self.traffic = {cu_id: (sum(self.tensor_bytes[n] for n in cu["inputs"]),
                                sum(self.tensor_bytes[n] for n in cu["outputs"])) for cu_id, cu in self.cus.items()}
        self.placement = {cu_id: self.cus[cu_id].get("runs_on", device) for cu_id in dag["order"]}
        self.devices: dict[str, Device] = {}
        for name in dict.fromkeys([device, *self.placement.values()]):
            ids = [cu_id for cu_id in dag["order"] if self.placement[cu_id] == name]
            if ids or name == device and not self.placement:
                part = {**dag, "cus": [self.cus[i] for i in ids], "order": ids}
                self.devices[name] = device_spec(name).open(part, Path(dag_path))
        self.branches = Branches(dag)
        self.last_skipped: list[dict] = []     # [{"cu", "reason"}] of the latest request

    def load(self) -> None:
        """Every CU resident on its device, before the first request."""
        for name, device in self.devices.items():
            device.load([self.cus[cu_id] for cu_id in self.dag["order"] if self.placement[cu_id] == name])

    def run(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[dict]]:
        """The model's outputs (host arrays the caller owns) and what ran, one entry per CU."""
        env: dict[str, tuple[str | None, object]] = {name: (HOST, value) for name, value in feeds.items()}
        copies: dict[tuple[str, str], object] = {}      # (tensor, device) -> the tensor there
        trace, self.last_skipped = [], []
        conditions: dict[str, np.ndarray] = {}

        def value_of(name: str) -> np.ndarray:     # a condition's value on the host, once per request
            if name not in conditions:
                conditions[name] = self._on_host(env[name])
            return conditions[name]

        for cu_id in self.dag["order"]:
            cu, where = self.cus[cu_id], self.placement[cu_id]
            reason = self.branches.skip_reason(cu, value_of)
            if reason is not None:
                self.last_skipped.append({"cu": cu_id, "reason": reason})
                continue
            device = self.devices[where]
            crossed = 0
            inputs = {}
            for name in cu["inputs"]:
                home, tensor = env[name]
                if home != where:
                    if (name, where) not in copies:
                        host = tensor if home is HOST else self.devices[home].to_host(tensor)
                        copies[name, where] = device.to_device(host)
                        crossed += self.tensor_bytes[name] if home is not HOST else 0
                    tensor = copies[name, where]
                inputs[name] = tensor
            start = time.perf_counter()
            results = device.run(cu, inputs)
            seconds = time.perf_counter() - start
            env.update((name, (where, tensor)) for name, tensor in results.items())
            env.update((out, env[case]) for out, case in self.branches.selected(cu_id, value_of))
            bytes_in, bytes_out = self.traffic[cu_id]
            trace.append({"cu": cu_id, "device": where, "op_types": cu.get("op_types", []), "start": start,
                          "seconds": seconds, "bytes_in": bytes_in, "bytes_out": bytes_out,
                          "bytes_from_other_devices": crossed,
                          "resident_bytes": device.resident_bytes(cu_id)})
        outputs = {spec["name"]: self._on_host(env[spec["name"]]) for spec in self.dag["outputs"]}
        return outputs, trace

    def _on_host(self, placed: tuple[str | None, object]) -> np.ndarray:
        home, tensor = placed
        return np.array(tensor) if home is HOST else self.devices[home].to_host(tensor)
