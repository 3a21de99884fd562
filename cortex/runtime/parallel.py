"""The threaded walk: ready CUs run at the same time on a pool of threads.

A CU is ready once every CU it depends on in dag.json's `edges` has had its turn (ran, was
skipped or was a cache hit); the edges include a branch CU's wait for its condition and a select
reader's wait for every case, so the sequential walk's decisions all have what they read. Those
decisions stay on the calling thread, in the sequential scheduler's own methods: `_skip_reason`
(inactive branch, not needed, cache hit), `_gather_inputs` (copies between devices), `_record`
(the outputs join the request, the cache stores them, the trace gets its entry) and `_settle`
(skips and selects). Only `_execute`, the device's run of one CU, goes to a thread, and it touches
nothing of the request. So policies, requested outputs, the result cache, variants and fallback
devices keep their semantics; the trace gains each entry's thread (0: the calling thread).

Why threads help at all: wasmtime-py calls into the engine through ctypes' `cdll`, which releases
the GIL for the whole call, and a CU's time is almost all inside that call. Each CU instance is
used by one thread at a time (a CU runs once per request and requests run one after the other);
the engine and its modules are shared, one store per instance (backends/wasm/instance.py).

Outputs of a wasm CU are views of its memory, valid until that CU runs again. A consumer on
another thread reads them while copying its inputs in; that is safe because a CU runs once per
request and the next request starts only after this one has waited for every thread it started,
errors included, so no producer can overwrite a view a consumer is still reading.

Devices that do not say `concurrent_runs = True` (a GPU, whose context belongs to the thread that
made it) run their CUs on the calling thread, still interleaved with the pool's work. So does the
last CU that can start at a moment (the only ready one, or the one filling the last free thread):
the calling thread would otherwise only wait, a chain pays no thread switches, and N slices of one
op cost N - 1 hand-offs. The pool therefore has N - 1 threads.
"""

from __future__ import annotations

import heapq
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from backends.limits import SandboxLimits
from cortex.runtime.cache import ResultCache
from cortex.runtime.policy import Policy
from cortex.runtime.scheduler import Execution, Request, SequentialScheduler
from ir.errors import CortexError

CALLING_THREAD = 0


def machine_threads() -> int:
    """The cores this process may run on: the default number of threads."""
    counted = getattr(os, "process_cpu_count", None)      # Python 3.13+
    if counted is not None:
        return max(1, counted() or 1)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                                  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def check_threads(threads) -> int:
    """`threads` as a count of threads, or one error saying what is allowed."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise CortexError(f"threads must be a whole number of at least 1 (got {threads!r})")
    return threads


class ThreadedScheduler(SequentialScheduler):
    def __init__(self, dag: dict, dag_path: Path, device: str, cache: ResultCache | None = None,
                 threads: int = 2, limits: SandboxLimits | None = None):
        super().__init__(dag, dag_path, device, cache, limits)
        self.threads = check_threads(threads)
        self.position = {cu_id: i for i, cu_id in enumerate(dag["order"])}
        self.waits_for: dict[str, set[str]] = {cu_id: set() for cu_id in dag["order"]}
        self.unblocks: dict[str, set[str]] = {cu_id: set() for cu_id in dag["order"]}
        for edge in dag["edges"]:
            self.waits_for[edge["to"]].add(edge["from"])
            self.unblocks[edge["from"]].add(edge["to"])
        self.pooled = {cu_id: bool(getattr(self.devices[where], "concurrent_runs", False))
                       for cu_id, where in self.placement.items()}
        # The calling thread runs one of the CUs that run at once, the pool the others.
        self.pool = ThreadPoolExecutor(max(self.threads - 1, 1), thread_name_prefix="cortex-cu")
        self._numbers: dict[int, int] = {}
        self._numbers_lock = threading.Lock()
        self._caller = threading.get_ident()

    def run(self, feeds: dict[str, np.ndarray], policy: Policy,
            outputs: list[str]) -> tuple[dict[str, np.ndarray], Request]:
        request = self._new_request(feeds, policy, outputs)
        self._caller = threading.get_ident()
        waiting = {cu_id: len(preds) for cu_id, preds in self.waits_for.items()}
        ready = [(self.position[cu_id], cu_id) for cu_id, n in waiting.items() if n == 0]
        heapq.heapify(ready)
        running: dict[Future, tuple[dict, int, bytes | None]] = {}

        def done_with(cu_id: str) -> None:
            for successor in self.unblocks[cu_id]:
                waiting[successor] -= 1
                if waiting[successor] == 0:
                    heapq.heappush(ready, (self.position[successor], successor))

        try:
            # Each pass starts or settles at least one CU, or waits for one to finish, so the loop
            # ends after at most two passes per CU.
            while ready or running:
                here = None             # the CU this thread runs itself in this pass
                while ready and here is None and len(running) < self.threads:
                    _, cu_id = heapq.heappop(ready)
                    cu = self.cus[cu_id]
                    request.key, request.hit = None, None
                    reason = self._skip_reason(cu, request)
                    if reason is not None:
                        self._settle(cu_id, reason, request)
                        done_with(cu_id)
                        continue
                    inputs, crossed = self._gather_inputs(cu, request)
                    self.variants.prepare(cu_id, policy)     # loading stays on this thread
                    # The last CU that can start now runs here: this thread would only wait, and a
                    # hand-off costs a thread wake-up, which on a busy machine takes longer than a small CU.
                    last = not ready or len(running) == self.threads - 1
                    if self.pooled[cu_id] and not last:
                        running[self.pool.submit(self._execute_pooled, cu, inputs, policy)] = (cu, crossed, request.key)
                    else:
                        here = cu, inputs, crossed, request.key
                if here is not None:
                    cu, inputs, crossed, key = here
                    self._record(cu, request, self._numbered(self._execute(cu, inputs, policy)), crossed, key)
                    self._settle(cu["id"], None, request)
                    done_with(cu["id"])
                if not running:
                    continue
                # With CUs ready to start, only collect what has finished; otherwise wait for one.
                can_start = ready and len(running) < self.threads
                finished, _ = wait(running, timeout=0 if can_start else None, return_when=FIRST_COMPLETED)
                for future in sorted(finished, key=lambda f: self.position[running[f][0]["id"]]):
                    cu, crossed, key = running.pop(future)
                    self._record(cu, request, future.result(), crossed, key)
                    self._settle(cu["id"], None, request)
                    done_with(cu["id"])
        except BaseException:
            # No thread may still write into a CU's memory once this request is over.
            wait(running)
            raise
        request.activated.sort(key=lambda entry: entry["start"])
        request.skipped.sort(key=lambda entry: self.position[entry["cu"]])
        return self._results(outputs, request), request

    def _execute_pooled(self, cu: dict, inputs: dict, policy: Policy) -> Execution:
        return self._numbered(self._execute(cu, inputs, policy))

    def _numbered(self, run: Execution) -> Execution:
        """The run with the small number of the thread that did it (0: the calling thread)."""
        ident = threading.get_ident()
        if ident == self._caller:
            number = CALLING_THREAD
        else:
            with self._numbers_lock:
                number = self._numbers.setdefault(ident, len(self._numbers) + 1)
        run.where = {"thread": number}     # the run is this thread's own, fresh from _execute
        return run
