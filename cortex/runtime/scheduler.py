"""The scheduler decides which CUs run, in what order and where; a Device only runs what it is
handed. Today it runs every CU, one at a time, in dag.json's topological order, on one device.

The later runtime features live here: activation of conditional CUs, the result cache, memory
tiers with prefetch, threads and remote executors all change which CU runs next, never how a CU
runs.
"""

from __future__ import annotations

import time

import numpy as np

from backends.registry import Device


class SequentialScheduler:
    def __init__(self, dag: dict, device: Device):
        self.dag = dag
        self.device = device
        self.cus = {cu["id"]: cu for cu in dag["cus"]}
        self.tensor_bytes = {name: t["bytes"] for name, t in dag["tensors"].items()}

    def load(self) -> None:
        """Every CU resident, before the first request."""
        self.device.load([self.cus[cu_id] for cu_id in self.dag["order"]])

    def run(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[dict]]:
        """The model's outputs (host arrays the caller owns) and what ran, one entry per CU."""
        env = {name: self.device.to_device(value) for name, value in feeds.items()}
        trace = []
        for cu_id in self.dag["order"]:
            cu = self.cus[cu_id]
            start = time.perf_counter()
            results = self.device.run(cu, {name: env[name] for name in cu["inputs"]})
            seconds = time.perf_counter() - start
            env.update(results)
            trace.append({"cu": cu_id, "op_types": cu.get("op_types", []), "start": start, "seconds": seconds,
                          "bytes_in": sum(self.tensor_bytes[n] for n in cu["inputs"]),
                          "bytes_out": sum(self.tensor_bytes[n] for n in cu["outputs"]),
                          "resident_bytes": self.device.resident_bytes(cu_id)})
        outputs = {spec["name"]: self.device.to_host(env[spec["name"]]) for spec in self.dag["outputs"]}
        return outputs, trace
