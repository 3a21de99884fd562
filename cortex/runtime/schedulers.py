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


# Below this share of its flops off the critical path, a model gains too little from threads to
# give up segments (a tenth of its work at best).
MIN_PARALLEL_SHARE = 0.1


def gains_from_threads(dag: dict) -> bool:
    """Whether CUs running at once could take a tenth of the model's work off its critical path
    (build-dag's `critical_path`, by flops; without one, assume they could)."""
    critical = dag.get("critical_path", {}).get("flops")
    total = sum(int(cu.get("flops") or 0) for cu in dag["cus"])
    if critical is None or total <= 0:
        return True
    return 1 - critical / total >= MIN_PARALLEL_SHARE


# From this share of its flops in CUs whose contractions run as parts on threads (`--wasm-features
# threads`), a model's cores go to those parts: its CUs run one after the other, each on every core.
MIN_SPLIT_SHARE = 0.5


def split_share(dag: dict) -> float:
    """The share of the model's flops in CUs that split their contractions into parts."""
    total = sum(int(cu.get("flops") or 0) for cu in dag["cus"])
    split = sum(int(cu.get("flops") or 0) for cu in dag["cus"]
                if "threads" in cu.get("artifacts", {}).get("wasm", {}).get("memory", {}))
    return split / total if total > 0 else 0.0


def open_scheduler(dag: dict, dag_path: Path, device: str, options: RuntimeOptions, cache: ResultCache,
                   threads: int) -> Scheduler:
    """The scheduler `options` ask for, its CUs loaded (and the variants of `options.policy`)."""
    if options.executor == "ray":
        return RayExecutor(dag, dag_path, device, options)
    # Memory tiers plan loads and evictions in dag.json's order: under a budget one CU runs at a time.
    # Unless asked for threads, a model whose critical path holds nearly all its work runs on one
    # thread: threads could save little, and a sequential walk runs its CUs in segments.
    # A model whose work is mostly split into parts runs its CUs in order, each on all the threads:
    # ready CUs at once as well would put two threads on each core, one waiting on the other.
    # In a threads build, threads asked for are the parts' threads too: a model that gains nothing
    # from CUs at once runs its CUs in order even then (shufflenet: 0.92x on 2 threads otherwise).
    share = split_share(dag)
    sequential = threads == 1 or share >= MIN_SPLIT_SHARE \
        or ((options.threads is None or share > 0) and not gains_from_threads(dag))
    if sequential or options.memory_budget_bytes is not None:
        pins = None if options.pins is None else list(options.pins)
        scheduler = SequentialScheduler(dag, dag_path, device, cache, options.limits, options.memory_budget_bytes,
                                        pins, options.segments)
    else:
        scheduler = ThreadedScheduler(dag, dag_path, device, cache, threads, options.limits)
    # A CU's split contractions (`--wasm-features threads`) run on as many threads as the model has.
    scheduler.use_kernel_threads(threads)
    scheduler.load(options.policy)
    return scheduler
