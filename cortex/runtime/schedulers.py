"""What a compiled model asks of whatever runs its CUs (`Scheduler`), and which one it gets.

Three implement it: the sequential walk (`scheduler.SequentialScheduler`: one CU after the other,
and the only one that keeps CUs within a memory budget), the threaded walk
(`parallel.ThreadedScheduler`: ready CUs at once) and the Ray executor (`ray_executor.RayExecutor`:
the CUs on Ray actors). The model (`loader.CompiledModel`) only calls what the protocol names;
`open_scheduler` is the one place that picks among them, from the model's `RuntimeOptions`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from backends.registry import Device
from cortex.runtime.cache import ResultCache
from cortex.runtime.options import RuntimeOptions
from cortex.runtime.parallel import ThreadedScheduler
from cortex.runtime.policy import Policy
from cortex.runtime.ray_executor import RayExecutor
from cortex.runtime.request import Request
from cortex.runtime.scheduler import SequentialScheduler


class Scheduler(Protocol):
    devices: dict[str, Device]          # the devices in this process, by name (none for Ray actors)
    cache: ResultCache | None           # the result cache in this process (None: each Ray actor has its own)

    def run(self, feeds: dict[str, np.ndarray], policy: Policy,
            outputs: list[str]) -> tuple[dict[str, np.ndarray], Request]:
        """One request: the requested outputs (host arrays the caller owns) and what it did."""

    def run_many(self, batch: list[dict[str, np.ndarray]], policy: Policy,
                 outputs: list[str]) -> list[tuple[dict[str, np.ndarray], Request]]:
        """`run` on each feed of `batch`, in order (on Ray, in flight together)."""

    def resident_bytes(self) -> int:
        """The bytes the loaded CUs hold."""

    def sandbox_events(self) -> dict[str, int]:
        """What the sandboxes in this process stopped over the model's life (traps, timeouts, ...)."""

    def close(self) -> bool:
        """Free what it holds besides the loaded CUs (threads); True when its CUs went too (Ray's
        actors) and a later request needs a new scheduler."""


def open_scheduler(dag: dict, dag_path: Path, device: str, options: RuntimeOptions, cache: ResultCache,
                   threads: int) -> Scheduler:
    """The scheduler `options` ask for, its CUs loaded (and the variants of `options.policy`)."""
    if options.executor == "ray":
        return RayExecutor(dag, dag_path, device, options)
    # Memory tiers plan loads and evictions in dag.json's order: under a budget one CU runs at a time.
    if threads == 1 or options.memory_budget_bytes is not None:
        pins = None if options.pins is None else list(options.pins)
        scheduler = SequentialScheduler(dag, dag_path, device, cache, options.limits, options.memory_budget_bytes,
                                        pins, options.segments)
    else:
        scheduler = ThreadedScheduler(dag, dag_path, device, cache, threads, options.limits)
    scheduler.load(options.policy)
    return scheduler
