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

The pool is lean because a hand-off costs more than many small CUs: N - 1 daemon threads, started
at the first hand-off, each blocking on its own task queue, and one completion queue the calling
thread blocks on (one wait in C, no future per CU). A worker sends back its run or its error; the
calling thread re-raises an error only once every CU it started has finished. `close()` (and
`Model.close()`) stops the threads, and so does the scheduler's collection; a later request
starts them again. Thread n (1 to N - 1) is the pool's nth worker; a hand-off goes to the lowest
free one.
"""

from __future__ import annotations

import heapq
import os
import queue
import threading
import weakref
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
        self.unblocks: dict[str, tuple[str, ...]] = {cu_id: () for cu_id in dag["order"]}
        for edge in dag["edges"]:
            self.waits_for[edge["to"]].add(edge["from"])
        for cu_id, preds in self.waits_for.items():
            for pred in preds:
                self.unblocks[pred] += (cu_id,)
        self.pooled = {cu_id: bool(getattr(self.devices[where], "concurrent_runs", False))
                       for cu_id, where in self.placement.items()}
        # The calling thread runs one of the CUs that run at once, the pool the others.
        self.pool = WorkerPool(max(self.threads - 1, 1))
        # The workers hold no reference to the scheduler: once it is collected they are told to stop.
        # At exit they are left alone (daemon threads, idle between requests), so exit never waits.
        weakref.finalize(self, self.pool.close, False).atexit = False

    def close(self) -> None:
        """Stop the pool's threads (a later request starts them again)."""
        self.pool.close()

    def run(self, feeds: dict[str, np.ndarray], policy: Policy,
            outputs: list[str]) -> tuple[dict[str, np.ndarray], Request]:
        request = self._new_request(feeds, policy, outputs)
        waiting = {cu_id: len(preds) for cu_id, preds in self.waits_for.items()}
        ready = [(self.position[cu_id], cu_id) for cu_id, n in waiting.items() if n == 0]
        heapq.heapify(ready)
        pool, threads, position, unblocks = self.pool, self.threads, self.position, self.unblocks
        idle = list(range(threads - 1))       # free workers, lowest first
        running: dict[int, tuple[dict, int, bytes | None]] = {}       # worker -> what it runs

        def done_with(cu_id: str) -> None:
            for successor in unblocks[cu_id]:
                waiting[successor] -= 1
                if waiting[successor] == 0:
                    heapq.heappush(ready, (position[successor], successor))

        def finished(worker: int, run: Execution | None, error: BaseException | None) -> None:
            heapq.heappush(idle, worker)
            cu, crossed, key = running.pop(worker)
            if error is not None:
                raise error
            run.where = {"thread": worker + 1}     # the run is this worker's own, fresh from _execute
            self._record(cu, request, run, crossed, key)
            self._settle(cu["id"], None, request)
            done_with(cu["id"])

        try:
            # Each pass starts or settles at least one CU, or waits for one to finish, so the loop
            # ends after at most two passes per CU.
            while ready or running:
                here = None             # the CU this thread runs itself in this pass
                while ready and here is None and len(running) < threads:
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
                    if self.pooled[cu_id] and ready and len(running) < threads - 1:
                        worker = heapq.heappop(idle)
                        pool.submit(worker, self._execute, cu, inputs, policy)
                        running[worker] = cu, crossed, request.key
                    else:
                        here = cu, inputs, crossed, request.key
                if here is not None:
                    cu, inputs, crossed, key = here
                    run = self._execute(cu, inputs, policy)
                    run.where = {"thread": CALLING_THREAD}
                    self._record(cu, request, run, crossed, key)
                    self._settle(cu["id"], None, request)
                    done_with(cu["id"])
                if not running:
                    continue
                # With CUs ready to start, only collect what has finished; otherwise wait for one.
                # Several finished ones are recorded in dag.json's order, as the sequential walk would.
                done = [] if ready and len(running) < threads else [pool.done.get()]
                while not pool.done.empty():
                    done.append(pool.done.get())
                if len(done) > 1:
                    done.sort(key=lambda d: position[running[d[0]][0]["id"]])
                for i, (worker, run, error) in enumerate(done):
                    try:
                        finished(worker, run, error)
                    except BaseException:
                        for later in done[i + 1:]:
                            running.pop(later[0])
                        raise
        except BaseException:
            # No thread may still write into a CU's memory once this request is over.
            while running:
                running.pop(pool.done.get()[0])
            raise
        request.activated.sort(key=lambda entry: entry["start"])
        request.skipped.sort(key=lambda entry: self.position[entry["cu"]])
        return self._results(outputs, request), request


class WorkerPool:
    """Persistent daemon threads, one task queue each, and one queue of what they finished:
    (worker, result, None) or (worker, None, error). Started at the first task."""

    def __init__(self, workers: int):
        self.workers = workers
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.tasks: list[queue.SimpleQueue] = []
        self.alive: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, worker: int, fn, *args) -> None:
        if not self.alive:
            self._start()
        self.tasks[worker].put((fn, args))

    def _start(self) -> None:
        with self._lock:
            if self.alive:
                return
            self.tasks = [queue.SimpleQueue() for _ in range(self.workers)]
            self.alive = [threading.Thread(target=_serve, args=(i, tasks, self.done), daemon=True,
                                           name=f"cortex-cu-{i + 1}") for i, tasks in enumerate(self.tasks)]
            for thread in self.alive:
                thread.start()

    def close(self, wait: bool = True) -> None:
        """Stop the threads once they finish what they hold (`wait`: and join them); called
        again, it does nothing."""
        with self._lock:
            alive, tasks, self.alive, self.tasks = self.alive, self.tasks, [], []
        for q in tasks:
            q.put(None)
        for thread in alive if wait else ():
            if thread is not threading.current_thread():
                thread.join()


def _serve(worker: int, tasks: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    """A worker's life: run each task, send back its result or its error, until told to stop."""
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args = task
        # Nothing of the task may stay in this frame while it waits: it would keep the scheduler alive.
        task = None
        try:
            result = fn(*args), None
        except BaseException as error:        # the calling thread re-raises it
            result = None, error
        fn = args = None
        done.put((worker, *result))
        result = None
