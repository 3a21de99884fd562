"""A CU module's `run` export called through wasmtime's C API directly.

wasmtime-py's `Func.__call__` asks the engine for the function's type, converts each parameter
and result and enters a context manager on every call: about 8 us on a 2020s x86 core, where a
64x64 matrix-vector product costs under 1 us. A CU's `run` takes no parameters and returns
nothing, so the call needs none of that: the arguments (the store's context, the function, no
values, a trap slot) are made once per instance and each call is one ctypes call (about 1 us with
the work). Reading the memory's size the same way skips a wrapper and a context lookup.

This reads wasmtime-py's private bindings (`wasmtime._bindings`), which pyproject.toml pins to one
major version; `DirectCall.supported` checks what it uses, and without it the instance calls the
public API instead. Traps and errors are raised as the public API raises them (`wasmtime.Trap`,
`wasmtime.WasmtimeError`), so the sandbox reads them the same way. A CU module imports no host
function (only, with `--memory shared`, the model's memory), so no Python exception can be pending
behind a trap, which is why the public API's check for one is not needed.
"""

from __future__ import annotations

import ctypes

import wasmtime

try:
    from wasmtime import _bindings as capi
except ImportError:      # a wasmtime-py that moved its bindings: the public API is used
    capi = None

_NEEDED = ("_wasmtime_func_call", "_wasmtime_memory_data_size", "_wasmtime_context_set_epoch_deadline",
           "wasm_trap_t", "_wasmtime_func_type")


class DirectCall:
    """`run(store)` and `memory.data_len(store)` of one instance, as single C calls."""

    @staticmethod
    def supported(store: wasmtime.Store, func: wasmtime.Func) -> bool:
        """Whether the bindings hold what this class calls and `func` takes and returns nothing."""
        if capi is None or not all(hasattr(capi, name) for name in _NEEDED):
            return False
        kind = func.type(store)
        return not kind.params and not kind.results

    def __init__(self, store: wasmtime.Store, func: wasmtime.Func, memory: wasmtime.Memory):
        self._store = store                      # keeps the context below alive
        self._context = store._context()
        self._func = ctypes.byref(func._func)
        self._memory = ctypes.byref(memory._memory)
        self._call = capi._wasmtime_func_call
        self._size = capi._wasmtime_memory_data_size
        self._deadline = capi._wasmtime_context_set_epoch_deadline
        self._new_trap_slot()

    def _new_trap_slot(self) -> None:
        self._trap = ctypes.POINTER(capi.wasm_trap_t)()
        self._trap_ref = ctypes.byref(self._trap)

    def __call__(self, deadline_ticks: int | None) -> None:
        """One call of `run`, after setting the store's epoch deadline when given."""
        if deadline_ticks is not None:
            self._deadline(self._context, deadline_ticks)
        error = self._call(self._context, self._func, None, 0, None, 0, self._trap_ref)
        if error:
            raise wasmtime.WasmtimeError._from_ptr(error)
        if self._trap:
            trap = self._trap
            self._new_trap_slot()                # the Trap object owns the old pointer now
            raise wasmtime.Trap._from_ptr(trap)

    def memory_bytes(self) -> int:
        return self._size(self._context, self._memory)
