"""What one request knows while a scheduler walks its CUs (`Request`), and one CU's run (`Execution`).

A segment's CUs (cortex/runtime/plan.py) get their trace entries when the trace is read: the
request keeps the segment and its times, and `activated` merges them in, in the order they ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cortex.runtime.cache import CacheEntry
from cortex.runtime.memory import MemoryStats
from cortex.runtime.policy import Policy


@dataclass
class Request:
    """What one `run` knows while it walks the CUs."""
    policy: Policy
    needed: frozenset[str] | None                 # CUs a requested output depends on; None: all
    env: dict[str, tuple[str | None, object]]     # tensor -> (its device, the tensor there)
    keys: dict[str, bytes] = field(default_factory=dict)          # tensor -> content key (cache)
    copies: dict[tuple[str, str], object] = field(default_factory=dict)   # (tensor, device) -> tensor
    ran: list[dict] = field(default_factory=list)                 # trace entries so far (see `activated`)
    skipped: list[dict] = field(default_factory=list)             # {"cu", "reason"}
    cpu_seconds: float = 0.0                      # the calling thread's CPU time inside device runs
    live_bytes: int = 0                           # bytes of the tensors this request holds
    key: bytes | None = None                      # the current CU's cache key, when it has one
    hit: CacheEntry | None = None                 # the current CU's cache entry, on a hit
    conditions: dict[str, np.ndarray] = field(default_factory=dict)   # branch conditions, on the host
    position: int = -1                            # the current CU's place in dag.json's order
    made_by: dict[str, str] = field(default_factory=dict)     # tensor -> the CU whose memory holds it
    memory: MemoryStats | None = None             # under a memory budget: what the request loaded
    # Segments that ran, as (place in `ran`, segment, start, seconds, cpu seconds): their CUs'
    # entries are made when the trace is read, not on the request's path.
    segments: list[tuple] = field(default_factory=list)

    @property
    def activated(self) -> list[dict]:
        """One trace entry per CU that ran, in the order they ran."""
        if self.segments:
            merged, taken = [], 0
            for place, segment, start, seconds, cpu_seconds in self.segments:
                merged += self.ran[taken:place]
                taken = place
                at = start
                for entry, share in zip(segment.entries, segment.shares):
                    merged.append({**entry, "start": at, "seconds": seconds * share, "cpu_seconds": cpu_seconds * share})
                    at += seconds * share
            merged += self.ran[taken:]
            self.ran, self.segments = merged, []
        return self.ran

    @activated.setter
    def activated(self, entries: list[dict]) -> None:
        self.ran, self.segments = entries, []


@dataclass
class Execution:
    """One CU's run on its device: its outputs, what the variant runner says of it, and its timing."""
    results: dict
    variant: dict
    start: float                                  # time.perf_counter() when the call began
    seconds: float
    cpu_seconds: float                            # CPU time of the thread that ran it
    where: dict = field(default_factory=dict)     # {"thread": n} when a thread pool ran it
