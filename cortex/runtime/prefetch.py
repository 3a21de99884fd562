"""The prefetcher: one thread that loads CUs, in the order the scheduler asks, while CUs run.

Every load under a memory budget goes through it, so loads never race each other; the scheduler
decides what to load and reserves its bytes first (`cortex/runtime/memory.py`), and waits for a
CU only when its turn comes. A wasm CU runs with the GIL released (wasmtime calls through
ctypes), so the next CU's load overlaps the current one's compute. A load that fails is
re-raised in the thread that waits for that CU. The thread runs while there is something to do
and ends when the queue is empty (the next `submit` starts another), so an idle model holds no
thread and is freed like any object.

Unloads go through it too (`release`): freeing a memory of tens of MB unmaps it, which takes the
process's address-space lock and would stall the thread that runs the CUs. Each one runs before
any load still queued, so the memory a load was given room for is free before it starts, and a
CU released and then asked for again is unloaded before it is loaded.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ir.errors import CortexError

LOAD_TIMEOUT_S = 600.0      # a load that takes longer is reported, not waited for forever


class Prefetcher:
    def __init__(self, load: Callable[[str], None], unload: Callable[[str], object]):
        self._load, self._unload = load, unload
        self._queue: deque[str] = deque()
        self._unloads: deque[str] = deque()
        self._idle = threading.Condition()
        self._ready: dict[str, threading.Event] = {}
        self._errors: dict[str, BaseException] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._unload_error: BaseException | None = None

    def submit(self, cu_id: str, first: bool = False) -> None:
        """Load `cu_id` after the ones already asked for (before them with `first`)."""
        with self._lock:
            if cu_id in self._ready:
                return
            self._ready[cu_id] = threading.Event()
            (self._queue.appendleft if first else self._queue.append)(cu_id)
            self._start()

    def release(self, cu_id: str) -> None:
        """Unload `cu_id` on the thread, before any load still queued."""
        with self._lock:
            self._unloads.append(cu_id)
            self._start()

    def settle(self) -> None:
        """Block until nothing is queued or in flight (the end of a request)."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._thread is None, LOAD_TIMEOUT_S):
                raise CortexError(f"loading and unloading CUs took longer than {LOAD_TIMEOUT_S:g} s")
        error, self._unload_error = self._unload_error, None
        if error is not None:
            raise error

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="cortex-prefetch", daemon=True)
            self._thread.start()

    def pending(self) -> set[str]:
        """CUs asked for whose load has not finished (they must not be evicted yet)."""
        with self._lock:
            return {cu_id for cu_id, ready in self._ready.items() if not ready.is_set()}

    def wait(self, cu_id: str) -> None:
        """Block until `cu_id` is loaded; its load error, if it failed."""
        ready = self._ready[cu_id]
        if not ready.wait(LOAD_TIMEOUT_S):
            raise CortexError(f"{cu_id}: loading took longer than {LOAD_TIMEOUT_S:g} s")
        with self._lock:
            del self._ready[cu_id]
            error = self._errors.pop(cu_id, None)
        if error is not None:
            raise error

    def drain(self, cu_id: str) -> None:
        """Wait for a load nobody needs any more (its CU was skipped); its error, if any, is
        dropped with it: a request that runs the CU loads it again and meets the error then."""
        ready = self._ready.get(cu_id)
        if ready is None:
            return
        ready.wait(LOAD_TIMEOUT_S)
        with self._lock:
            del self._ready[cu_id]
            self._errors.pop(cu_id, None)

    def _work(self) -> None:
        while True:
            with self._idle, self._lock:
                if self._unloads:
                    cu_id, unloading = self._unloads.popleft(), True
                elif self._queue:
                    cu_id, unloading = self._queue.popleft(), False
                else:
                    self._thread = None
                    self._idle.notify_all()
                    return
            if unloading:
                try:
                    self._unload(cu_id)
                except Exception as e:  # noqa: BLE001  (re-raised by `settle`, at the end of the request)
                    self._unload_error = e
                continue
            try:
                self._load(cu_id)
            except Exception as e:  # noqa: BLE001  (any load error is re-raised where the CU is waited for)
                with self._lock:
                    self._errors[cu_id] = e
            self._ready[cu_id].set()
