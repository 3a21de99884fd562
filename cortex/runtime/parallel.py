"""The threaded walk: ready CUs run at the same time on N threads, the calling thread and N - 1
pool threads, each picking the next ready CU itself.

A CU is ready once every CU it depends on in dag.json's `edges` has had its turn (ran, was
skipped or was a cache hit); the edges include a branch CU's wait for its condition and a select
reader's wait for every case, so the sequential walk's decisions all have what they read. Those
decisions are the sequential scheduler's own methods: `_skip_reason` (inactive branch, not needed,
cache hit), `_gather_inputs` (copies between devices), `_record` (the outputs join the request,
the cache stores them, the trace gets its entry) and `_settle` (skips and selects). They touch the
request, so a thread makes them holding the request's lock; only `_execute`, the device's run of
one CU, which touches nothing of the request, runs without it. So policies, requested outputs, the
result cache, variants and fallback devices keep their semantics; the trace gains each entry's
thread (0: the calling thread).

No thread decides for the others. A thread that finishes a CU records it, settles what became
ready and goes on with the first ready CU in dag.json's order: a chain runs on one thread without
a hand-off, and a CU never waits for a busy thread to notice that its predecessor finished. Only
when more CUs are ready than threads are looking for work does a thread wake another: an idle one
waiting on the lock's condition, or else a pool thread not yet part of the request (through its
task queue). A model whose CUs form a chain therefore never wakes the pool.

Why threads help at all: wasmtime-py calls into the engine through ctypes' `cdll`, which releases
the GIL for the whole call, and a CU's time is almost all inside that call. Each CU instance is
used by one thread at a time (a CU runs once per request and requests run one after the other);
the engine and its modules are shared, one store per instance (backends/wasm/instance.py).

Outputs of a wasm CU are views of its memory, valid until that CU runs again. A consumer on
another thread reads them while copying its inputs in; that is safe because a CU runs once per
request and a request returns only once no thread runs one of its CUs, errors included, so no
producer can overwrite a view a consumer is still reading.

Devices that do not say `concurrent_runs = True` (a GPU, whose context belongs to the thread that
made it) run their CUs on the calling thread only, still interleaved with the pool's work.

An error in a CU, or in a thread's bookkeeping, stops every thread from starting another CU; the
calling thread raises it once none runs. `close()` (and `Model.close()`) stops the pool's threads,
and so does the scheduler's collection; a later request starts them again. Thread n (1 to N - 1)
is the pool's nth worker; a wake-up through the task queues goes to the lowest not yet woken.
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
from cortex.runtime.request import Request
from cortex.runtime.scheduler import SequentialScheduler

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


class ThreadedScheduler(SequentialScheduler):
    def __init__(self, dag: dict, dag_path: Path, device: str, cache: ResultCache | None = None,
                 threads: int = 2, limits: SandboxLimits | None = None):
        super().__init__(dag, dag_path, device, cache, limits)
        self.threads = threads          # at least 1: RuntimeOptions checked it
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
        self.pool = WorkerPool(max(self.threads - 1, 1))
        # The workers hold no reference to the scheduler between requests: once it is collected they
        # are told to stop. At exit they are left alone (daemon threads, idle), so exit never waits.
        weakref.finalize(self, self.pool.close, False).atexit = False

    def close(self) -> bool:
        """Stop the pool's threads (a later request starts them again: the scheduler stays usable)."""
        self.pool.close()
        return super().close()

    def threads_trace(self) -> dict:
        return {**super().threads_trace(), "walk": "threaded", "cu_threads": self.threads}

    def run(self, feeds: dict[str, np.ndarray], policy: Policy,
            outputs: list[str]) -> tuple[dict[str, np.ndarray], Request]:
        request = self._new_request(feeds, policy, outputs)
        walk = Walk(self, request, policy)
        walk.work(CALLING_THREAD)
        request.activated.sort(key=lambda entry: entry["start"])
        request.skipped.sort(key=lambda entry: self.position[entry["cu"]])
        return self._results(outputs, request), request


class Walk:
    """One request's CUs on the scheduler's threads: what is ready, what runs, the first error.
    Every field is read and written holding `lock`."""

    def __init__(self, scheduler: ThreadedScheduler, request: Request, policy: Policy):
        self.scheduler, self.request, self.policy = scheduler, request, policy
        self.lock = threading.Condition(threading.Lock())
        self.waiting = {cu_id: len(preds) for cu_id, preds in scheduler.waits_for.items()}
        # Ready CUs by their place in dag.json's order: any thread's, and the calling thread's alone.
        self.ready: list[tuple[int, str]] = []
        self.ready_here: list[tuple[int, str]] = []
        self.running = 0
        self.idle = 0                 # threads of the request waiting for a CU, not yet woken
        self.woken = 0                # pool threads asked to join the request
        self.error: BaseException | None = None
        for cu_id, n in self.waiting.items():
            if n == 0:
                self._push(cu_id)

    def work(self, thread: int) -> None:
        """Run ready CUs until none is left to run; on the calling thread, then wait until no
        thread runs one and raise the request's first error."""
        with self.lock:
            try:
                if thread == CALLING_THREAD:
                    self._wake()
                self._work(thread)
            except BaseException as error:      # a pool thread's, too: the calling thread raises it
                if self.error is None:
                    self.error = error
            self._notify_all()
            if thread != CALLING_THREAD:
                return
            while self.running:
                self.lock.wait()
            if self.error is not None:
                raise self.error

    def _work(self, thread: int) -> None:
        scheduler, request, policy = self.scheduler, self.request, self.policy
        while self.error is None:
            cu_id = self._pop(thread)
            if cu_id is None:
                if not (self.running or self.ready or self.ready_here):
                    return                      # every CU has had its turn
                self.idle += 1              # the thread that wakes it counts it off
                self.lock.wait()
                continue
            cu = scheduler.cus[cu_id]
            request.key, request.hit = None, None
            reason = scheduler._skip_reason(cu, request)
            if reason is not None:
                scheduler._settle(cu_id, reason, request)
                self._done_with(cu_id)
                continue
            inputs, crossed = scheduler._gather_inputs(cu, request)
            scheduler.variants.prepare(cu_id, policy)
            key = request.key
            self.running += 1
            self.lock.release()
            try:
                run, error = scheduler._execute(cu, inputs, policy), None
            except BaseException as raised:
                run, error = None, raised
            finally:
                self.lock.acquire()
                self.running -= 1
            if error is not None:
                raise error
            run.where = {"thread": thread}      # the run is this thread's own, fresh from _execute
            scheduler._record(cu, request, run, crossed, key)
            scheduler._settle(cu_id, None, request)
            self._done_with(cu_id)

    def _notify_all(self) -> None:
        self.lock.notify_all()
        self.idle = 0

    def _push(self, cu_id: str) -> None:
        entry = (self.scheduler.position[cu_id], cu_id)
        heapq.heappush(self.ready if self.scheduler.pooled[cu_id] else self.ready_here, entry)

    def _pop(self, thread: int) -> str | None:
        """The first ready CU in dag.json's order that `thread` may run."""
        ready = self.ready
        if thread == CALLING_THREAD and self.ready_here and (not ready or self.ready_here[0] < ready[0]):
            ready = self.ready_here
        return heapq.heappop(ready)[1] if ready else None

    def _done_with(self, cu_id: str) -> None:
        """`cu_id` had its turn: its successors may become ready, and threads are woken for those
        this one will not take itself."""
        scheduler = self.scheduler
        became_ready = 0
        for successor in scheduler.unblocks[cu_id]:
            self.waiting[successor] -= 1
            if self.waiting[successor] == 0:
                self._push(successor)
                became_ready += 1
        if became_ready:
            self._wake()

    def _wake(self) -> None:
        """Wake threads for the ready CUs beyond the one this thread takes next: idle threads of the
        request first, then pool threads not yet part of it."""
        if self.ready_here:
            self._notify_all()              # only the calling thread may take those
        others = len(self.ready) - 1
        if others <= 0:
            return
        if self.idle:
            woken = min(self.idle, others)
            self.lock.notify(woken)
            self.idle -= woken
            others -= woken
        pool = self.scheduler.pool
        while others > 0 and self.woken < pool.workers:
            pool.submit(self.woken, self.work, self.woken + 1)
            self.woken += 1
            others -= 1


class WorkerPool:
    """Persistent daemon threads, each running the tasks of its own queue. Started at the first task."""

    def __init__(self, workers: int):
        self.workers = workers
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
            self.alive = [threading.Thread(target=_serve, args=(tasks,), daemon=True, name=f"cortex-cu-{i + 1}")
                          for i, tasks in enumerate(self.tasks)]
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


def _serve(tasks: queue.SimpleQueue) -> None:
    """A worker's life: run each task (a `Walk.work`, which keeps its own errors), until told to stop."""
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args = task
        # Nothing of the task may stay in this frame while it waits: it would keep the scheduler alive.
        task = None
        fn(*args)
        fn = args = None
