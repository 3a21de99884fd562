"""A pool of loaded model instances, one request on each at a time.

A wasmtime store must not be entered by two threads at once, so each instance is a separate
`cortex.load(...)` with its own stores; a request borrows one, runs it on a worker thread (the
event loop keeps serving other clients meanwhile) and gives it back. An instance whose run failed
on the server's side (a CU trap) is replaced by a freshly loaded one before it serves again, so a
fault cannot leak into the next request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import numpy as np

from cortex.runtime import CompiledModel, load

LOG = logging.getLogger("cortex.serve")


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    trace: dict
    resident_bytes: int
    sandbox_events: dict[str, int]       # what the sandbox counted during this run (traps, timeouts, ...)


class RunFailed(Exception):
    """The model failed while running a request (not the request's fault); `trace` is the trace the
    model wrote for it, if it wrote one."""

    def __init__(self, message: str, trace: dict | None, sandbox_events: dict[str, int]):
        super().__init__(message)
        self.trace = trace
        self.sandbox_events = sandbox_events


class ModelPool:
    def __init__(self, dag_path: Path, device: str, policy: str, workers: int, memory_budget_mb: float | None,
                 load_options: dict | None = None):
        self.dag_path = Path(dag_path)
        self._load_options = {"device": device, "policy": policy, **(load_options or {})}
        if memory_budget_mb is not None:        # absent: cortex.load keeps every CU resident, its default
            self._load_options["memory_budget_mb"] = memory_budget_mb
        self.instances = [self._load() for _ in range(workers)]
        self.inputs = self.instances[0].inputs
        self.outputs = self.instances[0].outputs
        self.resident = [0] * workers
        self._idle: list[int] = list(range(workers))
        self._available: anyio.Semaphore | None = None

    def _load(self) -> CompiledModel:
        return load(self.dag_path, **self._load_options)

    async def run(self, feeds: dict[str, np.ndarray], outputs: list[str] | None, policy: str | None) -> RunResult:
        if self._available is None:          # made on the server's event loop, where it is awaited
            self._available = anyio.Semaphore(len(self.instances))
        async with self._available:
            slot = self._idle.pop()
            try:
                return await anyio.to_thread.run_sync(self._run_on, slot, feeds, outputs, policy)
            finally:
                self._idle.append(slot)

    def _run_on(self, slot: int, feeds: dict, outputs: list[str] | None, policy: str | None) -> RunResult:
        model = self.instances[slot]
        before, counted = model.last_trace, model.sandbox_events()
        try:
            results = model.run(feeds, outputs=outputs, policy=policy)
        except Exception as e:  # noqa: BLE001  (anything a run raises fails this request only)
            trace = model.last_trace if model.last_trace is not before else None
            events = _since(counted, model.sandbox_events())
            self._replace(slot)
            raise RunFailed(str(e) or type(e).__name__, trace, events) from None
        trace = model.last_trace
        self.resident[slot] = _resident_bytes(model, trace)
        return RunResult(results, trace, self.resident[slot], _since(counted, model.sandbox_events()))

    def _replace(self, slot: int) -> None:
        try:
            self.instances[slot] = self._load()
            self.resident[slot] = 0
        except Exception as e:  # noqa: BLE001  (the bundle changed on disk: keep serving with the old instance)
            LOG.warning("%s: could not reload a model instance after a failed run, keeping it: %s", self.dag_path, e)

    def resident_bytes(self) -> int:
        return sum(self.resident)


def _since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The model's sandbox counts over its life, as what one run added."""
    return {name: after[name] - before.get(name, 0) for name in after}


def _resident_bytes(model: CompiledModel, trace: dict) -> int:
    """The instance's resident CU bytes after a run: the memory tiers' own count when the trace has
    one, else the scheduler's (read on the thread that ran it, never from another)."""
    memory = trace.get("memory")
    if isinstance(memory, dict) and isinstance(memory.get("resident_bytes"), int):
        return memory["resident_bytes"]
    if trace.get("offline") is not None:     # the source model ran; no CU was loaded for it
        return 0
    return model.scheduler.resident_bytes()
