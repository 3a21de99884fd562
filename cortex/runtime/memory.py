"""Memory tiers: which CUs stay resident under a byte budget, and what a request cost in loads.

Each CU is in one of three tiers:
- resident: loaded on its device (a wasm CU instantiated, its weights in its linear memory);
- warm: not loaded, but its device can load it cheaply (a wasm CU's native code is cached on disk
  beside its module and mmapped on load, `backends/wasm/native_cache.py`; once loaded, its compiled
  module stays when it is evicted, so loading it again is one instantiation);
- cold: neither (a first load compiles it).

`ResidentSet` is the scheduler's policy object, the same for every target: it holds the resident
CUs in least-recently-used order with the bytes each holds (reserved at the footprint its device
announces before a load starts, so a load in flight is already counted), and picks the victims
that make room for the next CU: least recently used first, never a pinned CU, never one the
caller keeps (the CU about to run, the ones being prefetched). It decides; the scheduler unloads.

Pins: the CUs named by `pins=` / `--pin`, or else the hot CUs `cortex calibrate` recorded
(`cus[i].residency.hot`), as many as leave room for the largest other CU. A budget that cannot
hold the pins plus the largest unpinned CU is refused in one line that says how much is needed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from ir.errors import CortexError

MB = 1 << 20


def budget_bytes(memory_budget_mb) -> int | None:
    """The budget in bytes, from megabytes (None: no budget, every CU resident)."""
    if memory_budget_mb is None:
        return None
    if isinstance(memory_budget_mb, bool) or not isinstance(memory_budget_mb, (int, float)) \
            or not math.isfinite(memory_budget_mb) or memory_budget_mb <= 0:
        raise CortexError(f"the memory budget must be a positive number of MB (got {memory_budget_mb!r})")
    return int(memory_budget_mb * MB)


def parse_pins(text: str | None) -> list[str] | None:
    """`--pin cu-0003,cu-0007` as a list of CU ids (None: not given)."""
    if text is None:
        return None
    pins = [name.strip() for name in text.split(",")]
    if not all(pins):
        raise CortexError(f"--pin {text!r}: expected comma-separated CU ids, such as cu-0003,cu-0007")
    return pins


def choose_pins(cus: dict[str, dict], footprints: dict[str, int], budget: int, pins: list[str] | None) -> set[str]:
    """The pinned CUs: `pins` checked against dag.json, or the calibrated hot CUs that fit."""
    if pins is not None:
        unknown = [cu_id for cu_id in pins if cu_id not in cus]
        if unknown:
            raise CortexError(f"--pin: unknown CU {', '.join(map(repr, unknown))}: the model's CUs are "
                              f"{min(cus)} to {max(cus)}")
        return set(pins)
    chosen: set[str] = set()
    hot = [cu_id for cu_id, cu in cus.items() if cu.get("residency", {}).get("hot")]
    for cu_id in sorted(hot, key=lambda c: (-footprints[c], c)):
        if required_bytes(footprints, chosen | {cu_id})[0] <= budget:
            chosen.add(cu_id)
    return chosen


def required_bytes(footprints: dict[str, int], pins: set[str]) -> tuple[int, str | None]:
    """The smallest budget that runs every CU: the pins plus the largest other CU (and that CU)."""
    pinned = sum(footprints[cu_id] for cu_id in pins)
    others = [(size, cu_id) for cu_id, size in footprints.items() if cu_id not in pins]
    largest, largest_id = max(others, default=(0, None))
    return pinned + largest, largest_id


def check_budget(footprints: dict[str, int], pins: set[str], budget: int) -> None:
    needed, largest = required_bytes(footprints, pins)
    if budget < needed:
        pinned = needed - (footprints[largest] if largest else 0)
        parts = [f"{largest} holds {footprints[largest] / MB:.2f} MB"] if largest else []
        if pins:
            parts.append(f"{len(pins)} pinned CU{'s' if len(pins) > 1 else ''} hold {pinned / MB:.2f} MB")
        raise CortexError(f"the memory budget (--memory-budget) of {budget / MB:.3g} MB is too small: {' and '.join(parts)}; "
                          f"give at least {needed / MB:.2f} MB")


@dataclass
class MemoryStats:
    """What one request did to the resident set (the trace's `memory` object)."""
    budget_bytes: int | None
    pinned_cus: list[str]
    bytes_loaded: int = 0
    bytes_evicted: int = 0
    loads: int = 0
    evictions: int = 0
    prefetch_hits: int = 0          # the CU was loaded by the prefetcher, ahead of its turn
    prefetch_misses: int = 0        # the CU had to be loaded when its turn came
    already_resident: int = 0       # resident from an earlier request (or pinned)
    peak_resident_bytes: int = 0
    loaded: dict[str, int] = field(default_factory=dict)     # CU -> bytes loaded for it in this request
    ran: set[str] = field(default_factory=set)

    def document(self, resident_bytes: int) -> dict:
        return {"budget_bytes": self.budget_bytes, "pinned_cus": sorted(self.pinned_cus),
                "resident_bytes": resident_bytes, "peak_resident_bytes": max(self.peak_resident_bytes, resident_bytes),
                "bytes_loaded": self.bytes_loaded, "bytes_evicted": self.bytes_evicted, "loads": self.loads,
                "evictions": self.evictions, "prefetch_hits": self.prefetch_hits,
                "prefetch_misses": self.prefetch_misses, "already_resident": self.already_resident,
                "wasted_bytes": sum(n for cu_id, n in self.loaded.items() if cu_id not in self.ran)}


class ResidentSet:
    def __init__(self, budget: int, footprints: dict[str, int], pins: set[str]):
        check_budget(footprints, pins, budget)
        self.budget, self.footprints, self.pins = budget, footprints, pins
        self.resident: OrderedDict[str, int] = OrderedDict()    # least recently used first

    def used(self) -> int:
        return sum(self.resident.values())

    def free(self) -> int:
        return self.budget - self.used()

    def admit(self, cu_id: str) -> int:
        """Reserve the CU's footprint before its load starts; the bytes reserved."""
        self.resident[cu_id] = self.footprints[cu_id]
        return self.resident[cu_id]

    def settle(self, cu_id: str, actual: int) -> None:
        """What the loaded CU really holds (a module may grow its memory while it runs)."""
        self.resident[cu_id] = actual

    def touch(self, cu_id: str) -> None:
        self.resident.move_to_end(cu_id)

    def release(self, cu_id: str) -> None:
        self.resident.pop(cu_id, None)

    def victims(self, needed: int, keep: set[str]) -> list[str] | None:
        """The least recently used CUs whose eviction leaves `needed` bytes free, or None when
        evicting every CU that may go is not enough."""
        free, chosen = self.free(), []
        for cu_id, size in self.resident.items():
            if free >= needed:
                break
            if cu_id in self.pins or cu_id in keep:
                continue
            chosen.append(cu_id)
            free += size
        return chosen if free >= needed else None
