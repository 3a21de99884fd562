"""The host side of a CU whose module splits its large contractions into parts (`--features threads`,
backends/wasm/kernel_parts.py): its shared memory and the worker threads that take parts.

- `new_shared_memory(engine, pages)`: the module's memory, a wasm shared memory of a fixed size,
  which every thread's instance imports.
- `KernelThreads`: `count - 1` workers for one CU. Each is a daemon thread with an instance of the
  CU's module in a store of its own (a store is entered by one thread at a time), parked in the
  module's `work` export: it spins a little, then sleeps in `memory.atomic.wait32` until the CU's
  caller publishes a job. wasmtime-py calls through ctypes, which releases the GIL, so a parked or
  working worker holds no Python lock. A worker that traps records why, calls its instance's `fail`
  (the caller, waiting for the job, traps too) and goes back to `work` until the device, which
  rebuilds a failed CU with a fresh memory, stops it.

Instantiating a worker writes the module's active data segments (the weights) into the shared memory
again, the same bytes; workers start when the CU loads, before its first call, never during one.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import wasmtime
from wasmtime import _ffi as ffi

from backends.wasm.kernel_parts import FAULT
from backends.wasm.sandbox import NO_DEADLINE, trap_reason

PAGE = 65536


class SharedMemory(wasmtime.SharedMemory):
    """wasmtime-py 50's SharedMemory passes a pointer to its pointer as an import; this passes the
    pointer itself, as the C API's `wasmtime_extern_t` holds it."""

    def _as_extern(self):
        return ffi.wasmtime_extern_t(ffi.WASMTIME_EXTERN_SHAREDMEMORY,
                                     ffi.wasmtime_extern_union(sharedmemory=self.ptr()))

    def array(self) -> np.ndarray:
        """Every byte of the memory as a numpy array (it never moves: a shared memory cannot grow here)."""
        address = ctypes.cast(self.data_ptr(), ctypes.c_void_p).value
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.data_len()).from_address(address))


def new_shared_memory(engine: wasmtime.Engine, pages: int) -> SharedMemory:
    return SharedMemory(engine, wasmtime.MemoryType(wasmtime.Limits(pages, pages), shared=True))


class KernelThreads:
    """The workers of one CU instance: `count - 1` threads taking parts beside the calling one."""

    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module, memory: SharedMemory, control: int,
                 count: int, timed: bool, stop):
        """`stop`: the calling instance's export of that name, bound to its store, which sets the
        flag in the shared memory and wakes every worker (`close`)."""
        self._stop = stop
        raw = memory.array()
        self.control = raw[control:control + 64].view(np.int32)
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._workers = []
        for tid in range(1, count):
            store = wasmtime.Store(engine)
            if timed:       # an idle worker waits in a loop: the sandbox's deadlines apply to the caller
                store.set_epoch_deadline(NO_DEADLINE)
            instance = wasmtime.Instance(store, module, [memory])
            exports = instance.exports(store)
            thread = threading.Thread(target=self._work, args=(tid, store, exports["work"], exports["fail"]),
                                      name=f"cortex-kernel-{tid}", daemon=True)
            self._workers.append(thread)
        for thread in self._workers:
            thread.start()

    @property
    def count(self) -> int:
        return len(self._workers) + 1

    def _work(self, tid: int, store: wasmtime.Store, work, fail) -> None:
        while True:
            try:
                work(store, tid)
                return      # `stop`
            except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
                with self._lock:
                    self.errors.append(f"kernel thread {tid} trapped: {trap_reason(e)}")
                fail(store)

    def failure(self) -> str | None:
        """Why a worker failed the last call, if one did (and forget it)."""
        with self._lock:
            errors, self.errors = self.errors, []
        return errors[0] if errors else None

    def inject_fault(self, armed: bool = True) -> None:
        """Make the next worker to finish a part trap (the tests' way to fail a thread in the middle
        of a kernel); False: no fault."""
        self.control[FAULT // 4] = int(armed)

    def close(self) -> None:
        """Stop and join the workers (parked between calls)."""
        if self._workers:
            self._stop()
            for thread in self._workers:
                thread.join(timeout=5.0)
            self._workers = []
