"""The scheduler's side of memory tiers: make a CU resident before it runs, prefetch the next
ones, evict the least recently used, all within the budget of a `ResidentSet`.

Per request the scheduler calls `plan` once before the first CU and after each `acquire`:
`plan` walks dag.json's order ahead of the running CU and takes, in order, the CUs known to run
(`known_to_run`: not `not needed`, and for a conditional CU, its condition already decided for
it; an undecided one is passed over, never loaded) while they fit in the budget next to the pins,
the running CU and the CUs holding tensors still to be read; for each one not resident it evicts
victims, reserves its bytes and hands it to the prefetcher, which loads it on its own thread and
takes its first call's page faults there (`WasmDevice.prefault`). `acquire` waits for a prefetched
CU (a hit) or loads it on the spot (a miss).

Evicting a CU invalidates the tensors that live in its memory (a wasm CU's outputs are views
of it): each one a later CU, a condition, a select or the caller still reads is first copied to
the host; the others are dropped from the request. The unload itself runs on the prefetcher's
thread, ahead of the loads it makes room for.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.registry import Device
from cortex.runtime.memory import MemoryStats, ResidentSet
from cortex.runtime.prefetch import Prefetcher

HOST = None
END = float("inf")
# How far ahead `plan` looks, in CUs: a walk whose cost per CU does not grow with the model. Within
# it the budget alone bounds the prefetch: a run of CUs whose loads outlast their compute (vgg19's
# hundred slices of its first fully connected layer, 4 MB of weights each and under a millisecond
# of work) is loaded while the convolutions before it run, as far as the budget holds.
LOOKAHEAD = 64


class Residency:
    def __init__(self, resident_set: ResidentSet, devices: dict[str, Device], placement: dict[str, str],
                 cus: dict[str, dict], order: list[str], last_use: dict[str, float]):
        self.set = resident_set
        self.devices, self.placement, self.cus, self.order = devices, placement, cus, order
        self.last_use = last_use            # tensor -> position in `order` of its last reader (END: kept)
        self.prefetcher = Prefetcher(self._load, lambda cu_id: self._device(cu_id).unload(cu_id))
        self.claimed: set[str] = set()      # reserved CUs whose prefetched load nobody waited for yet

    def load_pins(self) -> None:
        for cu_id in sorted(self.set.pins):
            self.set.admit(cu_id)
            self._load(cu_id)
            self.set.settle(cu_id, self._device(cu_id).resident_bytes(cu_id))

    def stats(self) -> MemoryStats:
        return MemoryStats(self.set.budget, sorted(self.set.pins), peak_resident_bytes=self.resident_bytes())

    def resident_bytes(self) -> int:
        """What the devices report the resident CUs hold now."""
        return sum(self._device(cu_id).resident_bytes(cu_id) for cu_id in list(self.set.resident))

    def acquire(self, cu_id: str, request) -> None:
        """`cu_id` resident, for the CU about to run."""
        stats: MemoryStats = request.memory
        if cu_id in self.claimed:
            self._wait(cu_id)
            stats.prefetch_hits += 1
        elif cu_id in self.set.resident:
            stats.already_resident += 1
        else:
            self._reserve(cu_id, request, keep={cu_id}, force=True)
            self.prefetcher.submit(cu_id, first=True)
            self._wait(cu_id)
            stats.prefetch_misses += 1
        self.set.settle(cu_id, self._device(cu_id).resident_bytes(cu_id))
        self.set.touch(cu_id)
        stats.ran.add(cu_id)

    def after_run(self, cu_id: str, request, position: int) -> int:
        """Settle what the CU holds after running; if it grew past the budget, evict to fit.
        The bytes the resident CUs hold now (the trace entry's `resident_total_bytes`)."""
        self.set.settle(cu_id, self._device(cu_id).resident_bytes(cu_id))
        if self.set.free() < 0:
            for victim in self.set.victims(0, {cu_id} | self.prefetcher.pending()) or []:
                self._evict(victim, request, position)
        total = self.resident_bytes()
        request.memory.peak_resident_bytes = max(request.memory.peak_resident_bytes, total)
        return total

    def plan(self, position: int, request, known_to_run: Callable[[dict], bool]) -> None:
        """Prefetch the CUs after `position` in the order that are known to run and fit."""
        running = self.order[position] if position >= 0 else None
        window: list[str] = []
        room = self.set.budget - sum(self.set.footprints[c] for c in self.set.pins) \
            - (self.set.footprints[running] if running and running not in self.set.pins else 0)
        # The producers of tensors still to be read stay too, where that leaves room for the next
        # CU: evicting one copies its outputs to the host, where they stay for the rest of the
        # request (a copy, and memory outside the budget).
        holding = self._holding(request, position) - self.set.pins - {running}
        held = sum(self.set.resident[c] for c in holding)
        for cu_id in self.order[position + 1:position + 1 + LOOKAHEAD]:
            if not known_to_run(self.cus[cu_id]):
                continue
            size = 0 if cu_id in self.set.pins else self.set.footprints[cu_id]
            if not window:
                if size + held <= room:
                    room -= held
                else:
                    holding = set()
            if size > room:
                break
            room -= size
            window.append(cu_id)
        keep = {*window, *holding, *([running] if running else [])}
        for cu_id in window:
            if cu_id not in self.set.resident and not self._reserve(cu_id, request, keep):
                break
            if cu_id in self.claimed:
                self.prefetcher.submit(cu_id)

    def _holding(self, request, position: int) -> set[str]:
        """The resident CUs holding, in their memory, a tensor that the CU at `position` or a
        later one still reads."""
        env, resident, placement = request.env, self.set.resident, self.placement
        return {cu_id for name, cu_id in request.made_by.items()
                if cu_id in resident and self.last_use.get(name, END) >= position
                and env.get(name, (HOST, None))[0] == placement[cu_id]}

    def finish(self, request) -> None:
        """At the end of a request no load or unload is left in flight: the CUs prefetched for CUs that were
        then skipped (a cache hit) land and stay resident, their bytes wasted for this request
        (in `MemoryStats.loaded`, never in `ran`)."""
        for cu_id in sorted(self.claimed):
            self._land(cu_id)
        self.prefetcher.settle()     # and every unload done: the devices hold what the set says

    def evict_idle(self, nbytes: int) -> int:
        """Between requests (no load in flight, no request's tensors to save): unload the least
        recently used CUs, unpinned ones before pinned ones, until `nbytes` are freed; the bytes
        freed. Another model sharing the budget asks for them (shape specializations); a pin
        evicted this way is loaded again when its CU next runs."""
        freed = 0
        order = [c for c in self.set.resident if c not in self.set.pins] + \
                [c for c in self.set.resident if c in self.set.pins]
        for cu_id in order:
            if freed >= nbytes:
                break
            freed += self.set.resident[cu_id]
            self._device(cu_id).unload(cu_id)
            self.set.release(cu_id)
        return freed

    def _reserve(self, cu_id: str, request, keep: set[str], force: bool = False) -> bool:
        """Evict what must go and reserve `cu_id`'s bytes; False when it cannot fit now (never with
        `force`: `check_budget` guaranteed the largest CU fits next to the pins)."""
        needed = self.set.footprints[cu_id]
        victims = self.set.victims(needed, keep | self.prefetcher.pending())
        if victims is None:
            if not force:
                return False
            for other in sorted(self.claimed - keep):     # loads in flight may go once they land
                self._land(other)
            victims = self.set.victims(needed, keep) or []
        for victim in victims:
            self._evict(victim, request, request.position)
        stats: MemoryStats = request.memory
        stats.bytes_loaded += self.set.admit(cu_id)
        stats.loaded[cu_id] = stats.loaded.get(cu_id, 0) + needed
        stats.loads += 1
        self.claimed.add(cu_id)
        return True

    def _evict(self, cu_id: str, request, position: int) -> None:
        if cu_id in self.claimed:
            self.claimed.discard(cu_id)
            self.prefetcher.drain(cu_id)     # a failed load of a CU being evicted matters to nobody
        device, where = self._device(cu_id), self.placement[cu_id]
        for name in [n for n, maker in request.made_by.items() if maker == cu_id]:
            home, tensor = request.env.get(name, (HOST, None))
            if home != where:
                continue
            if self.last_use.get(name, END) >= position:   # the running CU's inputs included
                request.env[name] = (HOST, device.to_host(tensor))
                request.live_bytes += int(request.env[name][1].nbytes)
            else:
                del request.env[name]
            del request.made_by[name]
        request.memory.bytes_evicted += device.resident_bytes(cu_id)
        self.prefetcher.release(cu_id)
        request.memory.evictions += 1
        self.set.release(cu_id)

    def _land(self, cu_id: str) -> None:
        """A claimed CU nobody waits for: its load finished, it is resident like any other."""
        self.claimed.discard(cu_id)
        self.prefetcher.drain(cu_id)
        actual = self._device(cu_id).resident_bytes(cu_id)
        if actual == 0 and self.set.footprints[cu_id] > 0:
            self.set.release(cu_id)      # its load failed: a request that runs it loads it again
        else:
            self.set.settle(cu_id, actual)

    def _wait(self, cu_id: str) -> None:
        """Wait for a claimed CU's load; one that failed holds nothing and leaves the resident set."""
        self.claimed.discard(cu_id)
        try:
            self.prefetcher.wait(cu_id)
        except BaseException:
            self.set.release(cu_id)
            raise

    def _device(self, cu_id: str) -> Device:
        return self.devices[self.placement[cu_id]]

    def _load(self, cu_id: str) -> None:
        """On the prefetcher's thread: the load, and the page faults of the CU's first call taken
        here rather than on the thread that runs it (a device that can: `WasmDevice.prefault`)."""
        device = self._device(cu_id)
        device.load([self.cus[cu_id]])
        prefault = getattr(device, "prefault", None)
        if prefault is not None:
            prefault(cu_id)
