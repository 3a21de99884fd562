"""Interleaved timing: every contestant runs a few repetitions in turn, round after round, so that
drift of the machine (frequency, a neighbour's load) hits all of them alike."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol


class Contestant(Protocol):
    name: str

    def time(self, warmup: int, repeat: int) -> list[float]:
        """Seconds of each of `repeat` runs, after `warmup` untimed ones."""


@dataclass
class Timings:
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    def to_json(self) -> dict:
        return {"median_s": self.median, "min_s": self.best, "runs": len(self.seconds)}


@dataclass
class InProcess:
    """A contestant that is a Python callable (onnxruntime, wasmtime)."""
    name: str
    run: Callable[[], object]

    def time(self, warmup: int, repeat: int) -> list[float]:
        for _ in range(warmup):
            self.run()
        out = []
        for _ in range(repeat):
            start = time.perf_counter()
            self.run()
            out.append(time.perf_counter() - start)
        return out


def interleave(contestants: list, rounds: int, repeat: int, warmup: int = 1) -> dict[str, Timings]:
    results = {c.name: Timings() for c in contestants}
    for c in contestants:  # first touch (page faults, lazy compilation) outside the rounds
        c.time(warmup, 0)
    for _ in range(rounds):
        for c in contestants:
            results[c.name].seconds += c.time(0, repeat)
    return results


def repeats_for(seconds_per_run: float, budget: float = 0.3, most: int = 50) -> int:
    """Runs per round so that a round of one contestant takes about `budget` seconds."""
    return max(1, min(most, int(budget / max(seconds_per_run, 1e-6))))
