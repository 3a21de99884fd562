"""A pool of loaded model instances, one request on each at a time, each loaded with the server's
`RuntimeOptions` (its memory budget is each instance's).

A wasmtime store must not be entered by two threads at once, so each instance is a separate
`cortex.load(...)` with its own stores; a request borrows one, runs it on a worker thread (the
event loop keeps serving other clients meanwhile) and gives it back. An instance whose run failed
on the server's side (a CU trap) is replaced by a freshly loaded one before it serves again, so a
fault cannot leak into the next request.

A model compiled for several input shapes is a `SpecializedModel` per instance, each loading a
specialization's CUs when a request first picks it on that instance; the pool answers which shapes
it serves (`shape_rule`, the model's own rule) and which specializations each instance has loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import numpy as np

from cortex.runtime import CompiledModel, load
from cortex.runtime.options import RuntimeOptions
from cortex.runtime.specialized import SpecializedModel
from cortex.serve.codec import RequestError
from cortex.serve.specializations import varying_specs
from ir.errors import CortexError

LOG = logging.getLogger("cortex.serve")


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    trace: dict
    resident_bytes: int
    sandbox_events: dict[str, int]       # what the sandbox counted during this run (traps, timeouts, ...)
    specialization: str | None = None    # the shape specialization it ran on (None: the model has one shape)


class RunFailed(Exception):
    """The model failed while running a request (not the request's fault); `trace` is the trace the
    model wrote for it, if it wrote one."""

    def __init__(self, message: str, trace: dict | None, sandbox_events: dict[str, int]):
        super().__init__(message)
        self.trace = trace
        self.sandbox_events = sandbox_events


class ModelPool:
    def __init__(self, dag_path: Path, device: str, options: RuntimeOptions, workers: int):
        self.dag_path, self.device, self.options = Path(dag_path), device, options
        self.instances = [self._load() for _ in range(workers)]
        first = self.instances[0]
        self.sections = first.sections if isinstance(first, SpecializedModel) else None
        self.inputs = varying_specs(self.sections, "inputs") if self.sections else first.inputs
        self.outputs = varying_specs(self.sections, "outputs") if self.sections else first.outputs
        self.resident = [0] * workers
        self.loaded = [_loaded_specializations(model) for model in self.instances]
        self._idle: list[int] = list(range(workers))
        self._available: anyio.Semaphore | None = None

    def _load(self) -> CompiledModel | SpecializedModel:
        return load(self.dag_path, self.device, options=self.options)

    def shape_rule(self, label: str) -> Callable[[dict[str, list[int]]], None] | None:
        """For a model of several shapes, a check that a request's input shapes are ones it runs
        (a RequestError naming the compiled shapes, `label` naming the model, when not); None for
        a model of one shape, whose every input has its one shape."""
        if self.sections is None:
            return None

        def check(shapes: dict[str, list[int]]) -> None:
            try:
                self.instances[0].specialization_for(shapes, label)
            except CortexError as e:
                raise RequestError(str(e)) from None
        return check

    def value_rule(self, label: str) -> Callable[[dict[str, np.ndarray]], None] | None:
        """For a model specialised by input values, a check that a request's values are compiled
        ones (a RequestError naming them, `label` naming the model, when not); None otherwise."""
        if self.sections is None or not self.instances[0].value_inputs:
            return None

        def check(feeds: dict[str, np.ndarray]) -> None:
            try:
                self.instances[0].with_values(feeds, label)
            except CortexError as e:
                raise RequestError(str(e)) from None
        return check

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
        self.loaded[slot] = _loaded_specializations(model)
        return RunResult(results, trace, self.resident[slot], _since(counted, model.sandbox_events()),
                         model.specialization if isinstance(model, SpecializedModel) else None)

    def _replace(self, slot: int) -> None:
        try:
            self.instances[slot] = self._load()
            self.resident[slot] = 0
            self.loaded[slot] = _loaded_specializations(self.instances[slot])
        except Exception as e:  # noqa: BLE001  (the bundle changed on disk: keep serving with the old instance)
            LOG.warning("%s: could not reload a model instance after a failed run, keeping it: %s", self.dag_path, e)

    def resident_bytes(self) -> int:
        return sum(self.resident)

    def instances_loaded(self) -> dict[str, int]:
        """Per specialization, how many instances hold its CUs loaded (as of their last request)."""
        return {s["name"]: sum(s["name"] in loaded for loaded in self.loaded) for s in self.sections or ()}


def _since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The model's sandbox counts over its life, as what one run added."""
    return {name: after[name] - before.get(name, 0) for name in after}


def _loaded_specializations(model) -> list[str]:
    return model.loaded_specializations() if isinstance(model, SpecializedModel) else []


def _resident_bytes(model: CompiledModel | SpecializedModel, trace: dict) -> int:
    """The instance's resident CU bytes after a run: for several shapes, every loaded
    specialization's; else the memory tiers' own count when the trace has one, else the
    scheduler's (read on the thread that ran it, never from another)."""
    if isinstance(model, SpecializedModel):
        return model.resident_bytes()
    memory = trace.get("memory")
    if isinstance(memory, dict) and isinstance(memory.get("resident_bytes"), int):
        return memory["resident_bytes"]
    if trace.get("offline") is not None:     # the source model ran; no CU was loaded for it
        return 0
    return model.scheduler.resident_bytes()
