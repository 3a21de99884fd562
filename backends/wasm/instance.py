"""Running one compiled module under wasmtime.

An instance owns its store and memory; inputs are written and outputs read through numpy views of
that memory at the offsets of the module's memory plan, so the host side is one copy in, one call,
and zero-copy views out. Views are rebuilt if the memory ever grows (growing may move it); only a
call of this instance can grow its memory (a shared memory cannot grow), so its size is read once,
after each call. The call goes through wasmtime's C API directly (`direct_call.py`): the public
API's per-call type checks cost several times a small CU's work.

Under the sandbox (backends/wasm/sandbox.py) the store is created with a memory limit, and each
call first sets the store's epoch deadline: an engine built with epoch interruption traps at once
in a store that never set one.
"""

from __future__ import annotations

import math

import ml_dtypes  # noqa: F401  (registers numpy's bfloat16 dtype, which tensors may use)
import numpy as np
import wasmtime

from backends.wasm.direct_call import DirectCall, RunCall
from backends.wasm.kernel_threads import SharedMemory
from ir.bounds import pad_into, real_part


class WasmInstance:
    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module, plan: dict,
                 memory_limit: int | None = None, deadline_ticks: int | None = None,
                 start_ticks: int | None = None, store: wasmtime.Store | None = None, imports: tuple = ()):
        # A given store holds other CUs too: the model's one memory, which the module imports
        # (--memory shared), or CUs with memories of their own that a segment runs in one call.
        self.store = store if store is not None else wasmtime.Store(engine)
        # A module that splits contractions into parts imports a shared memory of a fixed size, which
        # its worker threads' instances import too (kernel_threads.py).
        threaded = bool(imports) and isinstance(imports[0], SharedMemory)
        self.threaded_memory: SharedMemory | None = imports[0] if threaded else None
        # Only the model's imported memory can hold a producer's output where this module reads its input.
        self.shares_memory = bool(imports) and not threaded
        if memory_limit is not None:     # one instance with one memory: all a CU module has
            self.store.set_limits(memory_size=memory_limit, instances=1, memories=1)
        self.deadline_ticks = deadline_ticks
        if start_ticks is not None:      # a start function (copying passive weights in) runs now
            self.store.set_epoch_deadline(start_ticks)
        self.instance = wasmtime.Instance(self.store, module, list(imports))
        exports = self.instance.exports(self.store)
        self.exports = exports
        self.memory = exports["memory"] if not threaded else self.threaded_memory
        self._run = exports["run"]
        self._call = RunCall(self.store, self._run, None if threaded else self.memory)
        # Also reads the memory's size in one C call (a shared memory's never changes).
        self._direct: DirectCall | None = self._call.direct if not threaded else None
        self.plan = plan
        self._axes = {e["name"]: e["bound"]["axis"] for e in [*plan["inputs"], *plan["outputs"]] if "bound" in e}
        self.memory_size = -1      # the memory's size in bytes when the views were last built
        self._refresh_views()

    def _refresh_views(self) -> None:
        size = self.memory_bytes()
        if size == self.memory_size:
            return
        raw = self.threaded_memory.array() if self.threaded_memory is not None else \
            np.frombuffer(self.memory.get_buffer_ptr(self.store), dtype=np.uint8)
        self.inputs = {e["name"]: _view(raw, e) for e in self.plan["inputs"]}
        self.outputs = {e["name"]: _view(raw, e) for e in self.plan["outputs"]}
        self.lengths = {e["name"]: _length_view(raw, e["bound"]) for e in [*self.plan["inputs"], *self.plan["outputs"]]
                        if "bound" in e}
        self.memory_size = size

    def memory_bytes(self) -> int:
        if self.threaded_memory is not None:
            return self.threaded_memory.data_len()
        return self._direct.memory_bytes() if self._direct is not None else self.memory.data_len(self.store)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copy `inputs` in, run, and return views of the outputs (valid until the next run)."""
        for name, view in self.inputs.items():
            if name in self.lengths:     # a bounded tensor comes at its real shape (ir/bounds.py)
                self.lengths[name][0] = pad_into(view, inputs[name], self._axes[name])
            elif not (self.shares_memory and in_place(inputs[name], view)):   # --memory shared: the producer wrote it here
                view[...] = inputs[name]
        self._call(self.deadline_ticks)
        self._refresh_views()
        if not self.lengths:
            return self.outputs
        return {name: real_part(view, self._axes[name], int(self.lengths[name][0])) if name in self.lengths else view
                for name, view in self.outputs.items()}


def in_place(value, view: np.ndarray) -> bool:
    """Whether `value` already is `view`: the same bytes of the same memory, in the same layout."""
    return (isinstance(value, np.ndarray) and value.shape == view.shape and value.dtype == view.dtype
            and value.__array_interface__["data"][0] == view.__array_interface__["data"][0]
            and value.flags.c_contiguous)


def _length_view(raw: np.ndarray, bound: dict) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.int32, count=1, offset=bound["length_offset"])


def _view(raw: np.ndarray, entry: dict) -> np.ndarray:
    dtype = np.dtype(entry["dtype"])
    count = math.prod(entry["shape"])     # math.prod: np.prod costs more than the view itself
    return np.frombuffer(raw, dtype=dtype, count=count, offset=entry["offset"]).reshape(entry["shape"])
