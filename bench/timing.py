"""Interleaved timing: every contestant runs a few repetitions in turn, round after round, so that
drift of the machine (frequency, a neighbour's load) hits all of them alike.

Each run is timed twice: wall time, and the CPU time of the thread doing the work (onnxruntime with
one intra-op thread and wasmtime both compute on the calling thread; Node reports its process's CPU
time). The report uses CPU time: on an idle machine the two agree for single-threaded compute, and on
a shared one (other builds and tests running) CPU time is not inflated by waiting for a core.
Wall times stay in the JSON results."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol


class Contestant(Protocol):
    name: str

    def time(self, warmup: int, repeat: int) -> list[tuple[float, float]]:
        """(wall, cpu) seconds of each of `repeat` runs, after `warmup` untimed ones."""


@dataclass
class Timings:
    seconds: list[float] = field(default_factory=list)       # CPU time per run: what the report uses
    wall_seconds: list[float] = field(default_factory=list)

    def add(self, runs: list[tuple[float, float]]) -> None:
        self.wall_seconds += [wall for wall, _ in runs]
        self.seconds += [cpu for _, cpu in runs]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    def to_json(self) -> dict:
        return {"median_s": self.median, "min_s": self.best, "runs": len(self.seconds),
                "wall_median_s": statistics.median(self.wall_seconds) if self.wall_seconds else None,
                "wall_min_s": min(self.wall_seconds, default=None)}


@dataclass
class InProcess:
    """A contestant that is a Python callable (onnxruntime, wasmtime)."""
    name: str
    run: Callable[[], object]

    def time(self, warmup: int, repeat: int) -> list[tuple[float, float]]:
        for _ in range(warmup):
            self.run()
        out = []
        for _ in range(repeat):
            start, cpu = time.perf_counter(), time.thread_time()
            self.run()
            out.append((time.perf_counter() - start, time.thread_time() - cpu))
        return out


def interleave(contestants: list, rounds: int, repeat: int, warmup: int = 1) -> dict[str, Timings]:
    results = {c.name: Timings() for c in contestants}
    for c in contestants:  # first touch (page faults, lazy compilation) outside the rounds
        c.time(warmup, 0)
    for _ in range(rounds):
        for c in contestants:
            results[c.name].add(c.time(0, repeat))
    return results


def repeats_for(seconds_per_run: float, budget: float = 0.3, most: int = 50) -> int:
    """Runs per round so that a round of one contestant takes about `budget` seconds."""
    return max(1, min(most, int(budget / max(seconds_per_run, 1e-6))))
