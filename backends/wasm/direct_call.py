"""A CU module's `run` export called through wasmtime's C API directly.

wasmtime-py's `Func.__call__` asks the engine for the function's type, converts each parameter
and result and enters a context manager on every call: about 8 us on a 2020s x86 core, where a
64x64 matrix-vector product costs under 1 us. A CU's `run` takes no parameters and returns
nothing, so the call needs none of that: the arguments (the store's context, the function, no
values, a trap slot) are made once per instance, as plain addresses, and each call is one ctypes
call (about 1.5 us with the work on a busy 2-core machine). Reading the memory's size the same way
costs about 0.4 us instead of 1.4.

This reads wasmtime-py's private bindings (`wasmtime._bindings`), which pyproject.toml pins to one
major version; `DirectCall.supported` checks what it uses, and without it the instance calls the
public API instead. Traps and errors are raised as the public API raises them (`wasmtime.Trap`,
`wasmtime.WasmtimeError`), so the sandbox reads them the same way. A CU module imports no host
function (only, with `--memory shared`, the model's memory), so no Python exception can be pending
behind a trap, which is why the public API's check for one is not needed.
"""

from __future__ import annotations

import ctypes
from functools import cache

import wasmtime

try:
    from wasmtime import _bindings as capi
except ImportError:      # a wasmtime-py that moved its bindings: the public API is used
    capi = None

_NEEDED = ("dll", "wasm_trap_t", "wasmtime_error_t")
_SYMBOLS = ("wasmtime_func_call", "wasmtime_memory_data_size", "wasmtime_context_set_epoch_deadline")
_pointer = ctypes.c_void_p


@cache
def _c_function(name: str, restype, *argtypes):
    """A C function of wasmtime's library typed with plain pointers: ctypes checks a `c_void_p`
    argument in a fraction of the time it takes to check a typed pointer (about 1 us less a call).
    CFUNCTYPE's functions release the GIL during the call, as the bindings' own do."""
    address = ctypes.cast(getattr(capi.dll, name), _pointer).value
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


class DirectCall:
    """`run(store)` and `memory.data_len(store)` of one instance, as single C calls."""

    @staticmethod
    def supported(store: wasmtime.Store, func: wasmtime.Func) -> bool:
        """Whether the bindings hold what this class calls and `func` takes and returns nothing."""
        if capi is None or not all(hasattr(capi, name) for name in _NEEDED) \
                or not all(hasattr(capi.dll, name) for name in _SYMBOLS):
            return False
        kind = func.type(store)
        return not kind.params and not kind.results

    def __init__(self, store: wasmtime.Store, func: wasmtime.Func, memory: wasmtime.Memory | None):
        """`memory`: the instance's own memory, or None for a shared memory (a fixed size, read by its owner)."""
        self._owners = (store, func, memory)     # keep alive what the addresses below point into
        self._context = _pointer(ctypes.cast(store._context(), _pointer).value)
        self._func = _pointer(ctypes.addressof(func._func))
        self._memory = None if memory is None else _pointer(ctypes.addressof(memory._memory))
        self._call = _c_function("wasmtime_func_call", _pointer, _pointer, _pointer, _pointer, ctypes.c_size_t,
                                 _pointer, ctypes.c_size_t, _pointer)
        self._size = _c_function("wasmtime_memory_data_size", ctypes.c_size_t, _pointer, _pointer)
        self._deadline = _c_function("wasmtime_context_set_epoch_deadline", None, _pointer, ctypes.c_uint64)
        self._new_trap_slot()

    def _new_trap_slot(self) -> None:
        self._trap = ctypes.POINTER(capi.wasm_trap_t)()
        self._trap_ref = _pointer(ctypes.addressof(self._trap))

    def __call__(self, deadline_ticks: int | None) -> None:
        """One call of `run`, after setting the store's epoch deadline when given."""
        if deadline_ticks is not None:
            self._deadline(self._context, deadline_ticks)
        error = self._call(self._context, self._func, None, 0, None, 0, self._trap_ref)
        if error:
            raise wasmtime.WasmtimeError._from_ptr(ctypes.cast(error, ctypes.POINTER(capi.wasmtime_error_t)))
        if self._trap:
            trap = self._trap
            self._new_trap_slot()                # the Trap object owns the old pointer now
            raise wasmtime.Trap._from_ptr(trap)

    def memory_bytes(self) -> int:
        return self._size(self._context, self._memory)


class RunCall:
    """`run` of one instance after setting the store's epoch deadline (when given): one C call where
    the bindings allow it (`DirectCall`), else through the public API."""

    def __init__(self, store: wasmtime.Store, func: wasmtime.Func, memory: wasmtime.Memory | None):
        self.direct = DirectCall(store, func, memory) if DirectCall.supported(store, func) else None
        self._store, self._func = store, func

    def __call__(self, deadline_ticks: int | None) -> None:
        if self.direct is not None:
            self.direct(deadline_ticks)
            return
        if deadline_ticks is not None:
            self._store.set_epoch_deadline(deadline_ticks)
        self._func(self._store)
