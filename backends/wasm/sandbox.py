"""The sandbox each CU runs in on the wasm device: a memory limit, a time limit, a load timeout.

- Memory. A CU's store may hold `memory_limit(plan)` bytes of linear memory: the pages its memory
  plan declares plus `MEMORY_SLACK_PAGES`. The plan places every byte a generated module touches
  inside the declared pages and generated code never executes `memory.grow`, so a store whose
  memory is larger than its plan after a call ran a module that grew it: that call fails as a
  memory limit hit. The slack page is what makes such a module visible: wasmtime's `memory.grow`
  past a store's limit returns -1 without trapping (its Python API has no trap-on-grow-failure),
  so a module that asks for more than the limit in one step is refused quietly, never given the
  host's memory, and is caught only if it then traps or runs past its deadline.
- Time. The engine compiles epoch checks into every function entry and loop back-edge
  (`Config.epoch_interruption`); one daemon thread per process (`TICKER`) advances every live
  engine's epoch each `TICK_SECONDS`, and each call gets a deadline of `deadline_ticks(ms)` ticks.
  A CU's deadline is its cost estimate from dag.json (flops at `NOMINAL_FLOPS_PER_S` plus the bytes
  of its memory at `NOMINAL_BYTES_PER_S`, both far below what the kernels reach) times
  `DEADLINE_FACTOR`, at least `DEADLINE_FLOOR_MS`, under `cu_timeout_ms="auto"`; a number of ms
  replaces it for every CU, and none (the default of `cortex.load`, see backends/limits.py) or 0
  builds the engine without epoch checks at all. The ticker sleeps, so a loaded
  machine stretches ticks: a deadline can fire late, never early.
- Load. `load_within` loads CUs on a worker thread and waits at most `cu_load_timeout_s` for each
  (see its docstring for what happens to abandoned work).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import wasmtime

from backends.limits import AUTO_DEADLINE, SandboxLimits, no_sandbox_events
from ir.errors import CortexError

PAGE = 65536
MEMORY_SLACK_PAGES = 1
TICK_SECONDS = 0.01
NOMINAL_FLOPS_PER_S = 1e9
NOMINAL_BYTES_PER_S = 1e9
DEADLINE_FACTOR = 20.0
DEADLINE_FLOOR_MS = 1000.0
NO_DEADLINE = 1 << 62    # ticks: the engine adds it to the current epoch, so it must not overflow a u64


def planned_bytes(plan: dict) -> int:
    """The linear memory the module declares: its plan's bytes in whole pages (at least one)."""
    return max(1, -(-int(plan["memory_bytes"]) // PAGE)) * PAGE


def memory_limit(plan: dict) -> int:
    return planned_bytes(plan) + MEMORY_SLACK_PAGES * PAGE


def estimated_ms(cu: dict, plan: dict) -> float:
    """What the CU should cost at nominal (pessimistic) speeds, in milliseconds."""
    return 1e3 * (float(cu.get("flops") or 0) / NOMINAL_FLOPS_PER_S + planned_bytes(plan) / NOMINAL_BYTES_PER_S)


def deadline_ms(cu: dict, plan: dict, limits: SandboxLimits) -> float | None:
    """One call's time limit in milliseconds; None: no limit."""
    if not limits.timed:
        return None
    if limits.cu_timeout_ms != AUTO_DEADLINE:
        return float(limits.cu_timeout_ms)
    return max(DEADLINE_FLOOR_MS, DEADLINE_FACTOR * estimated_ms(cu, plan))


def deadline_ticks(ms: float | None) -> int:
    """Ticks after the current epoch: the current tick may be about to end, so one more."""
    return NO_DEADLINE if ms is None else math.ceil(ms / (TICK_SECONDS * 1e3)) + 1


class EpochTicker:
    """One daemon thread that advances the epoch of every live engine at a fixed period; it stops
    when no engine is left and starts again with the next one."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self._engines: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, engine: wasmtime.Engine) -> None:
        with self._lock:
            self._engines.add(engine)
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._tick, name="cortex-epoch-ticker", daemon=True)
            self._thread.start()

    def after_fork(self) -> None:
        """A forked child (a server's worker) inherits the engines but not the thread: start its own."""
        self._lock, self._thread = threading.Lock(), None
        if len(self._engines):
            self._start()

    def _tick(self) -> None:
        while True:
            time.sleep(self.period_s)
            with self._lock:
                engines = list(self._engines)
                if not engines:
                    self._thread = None
                    return
            for engine in engines:
                engine.increment_epoch()
            del engines


TICKER = EpochTicker(TICK_SECONDS)
os.register_at_fork(after_in_child=TICKER.after_fork)


@dataclass
class SandboxEvents:
    """What the sandbox stopped over the device's life (the trace's `sandbox_stats`)."""
    counts: dict[str, int] = field(default_factory=no_sandbox_events)

    def count(self, kind: str) -> None:
        self.counts[kind] += 1


TRAP, TIMEOUT, MEMORY = "traps", "timeouts", "memory_limit_hits"


def failure(cu: dict, error: Exception | None, memory_after: int, plan: dict, ms: float | None) -> tuple[str, str]:
    """(counter, one-line message) for a call that trapped (`error`) or grew its memory; a grown
    memory is named first, since it is the cause of whatever came after."""
    name = f"{cu['id']} ({', '.join(cu.get('op_types', [])) or 'no ops'})"
    if memory_after > planned_bytes(plan):
        then = f"; then {trap_reason(error)}" if error is not None else ""
        return MEMORY, (f"{name} exceeded its memory limit: it grew its memory to {memory_after} bytes, beyond the "
                        f"{planned_bytes(plan)} its plan declares (limit {memory_limit(plan)}){then}")
    if isinstance(error, wasmtime.Trap) and error.trap_code == wasmtime.TrapCode.INTERRUPT:
        return TIMEOUT, f"{name} timed out: still running after its deadline of {ms:g} ms (--cu-timeout-ms)"
    return TRAP, f"{name} trapped: {trap_reason(error)}"


def trap_reason(error: Exception | None) -> str:
    """wasmtime puts the backtrace first and the reason ("wasm trap: ...") last."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reasons = [line.partition("wasm trap: ")[2] for line in lines if "wasm trap: " in line]   # "1: wasm trap: ..."
    return reasons[-1] if reasons else (lines[-1] if lines else "unknown trap")


def load_within(cus: list[dict], load_one: Callable[[dict], object], timeout_s: float,
                abandon: Callable[[], None]) -> dict[str, object]:
    """`load_one(cu)` for each CU, in order, on one worker thread; the results by CU id.

    Each CU must load within `timeout_s` of its start, else a CortexError names it. wasmtime cannot
    interrupt a compile from Python, so the worker is abandoned, not stopped: `abandon()` tells it
    to write nothing more (it returns once a cache write in progress has finished, so no temporary
    file is left behind), the CU in hand finishes in the background, costing its CPU time, and is
    thrown away with the rest of the worker's results, and the worker loads no further CU. It is a
    daemon thread, so it never keeps the process from exiting."""
    results: queue.Queue = queue.Queue()
    stop = threading.Event()

    def work() -> None:
        for cu in cus:
            if stop.is_set():
                return
            try:
                results.put((cu["id"], load_one(cu), None))
            except BaseException as e:  # noqa: BLE001  (handed to the waiting thread, which raises it)
                results.put((cu["id"], None, e))
                return

    threading.Thread(target=work, name="cortex-cu-load", daemon=True).start()
    loaded: dict[str, object] = {}
    for cu in cus:
        try:
            cu_id, value, error = results.get(timeout=timeout_s)
        except queue.Empty:
            stop.set()
            abandon()
            raise CortexError(f"{cu['id']} ({', '.join(cu.get('op_types', [])) or 'no ops'}): loading took longer "
                              f"than the CU load timeout of {timeout_s:g} s (CU_LOAD_TIMEOUT, --cu-load-timeout-s); "
                              "its module may be too large to compile in time") from None
        if error is not None:
            raise error
        loaded[cu_id] = value
    return loaded
