"""The wasm device for a model built with `compile-wasm --memory shared`: one memory, one store.

Every CU's module imports `env.memory`, the model's one linear memory, sized by the plan in each
record (`artifacts.wasm.memory.shared`: the memory's bytes, the CU's region); this device makes
that memory once, in one wasmtime Store, and instantiates every CU's module in that store against
it. A CU's outputs are views of their slots in it, and a consumer's module reads those very slots,
so the instance copies nothing in (`instance.in_place`); only model inputs, cached outputs and
tensors from another device are written in, as before.

What changes against per-CU memories (`device.py`), and why (docs/runtime.md, "Shared memory"):
- Threads: a Store may be entered by one thread at a time, so `concurrent_runs` is off and the
  threaded scheduler runs these CUs on its calling thread: the walk is sequential.
- Memory limit: one for the model, not one per CU. The memory's maximum is its size, so a module
  cannot grow it at all (`memory.grow` returns -1).
- A trap, a timeout: any CU may have written anywhere in the shared memory, so the whole store is
  rebuilt, every loaded CU instantiated again and its weights written again (active segments,
  external weight files), and the error says so; `rebuilt` counts one per model rebuild.
- Eviction: a CU's region stays part of the memory when it is unloaded, so a memory budget could
  free nothing; `footprint` refuses one in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import wasmtime

from backends.limits import SandboxLimits
from backends.wasm.device import SandboxedCU, WasmDevice
from backends.wasm.instance import WasmInstance
from backends.wasm.native_cache import Stamps
from backends.wasm.sandbox import PAGE, deadline_ticks, failure
from ir.errors import CortexError

SHARED = "shared"


def shared_plan(dag: dict, dag_path: Path) -> int | None:
    """The bytes of the model memory the wasm records of `dag` import; None: each CU owns its memory."""
    sizes = {(cu["artifacts"]["wasm"]["memory"].get(SHARED) or {}).get("memory_bytes")
             for cu in dag["cus"] if "wasm" in cu.get("artifacts", {})}
    if sizes <= {None}:
        return None
    if len(sizes) > 1:
        raise CortexError(f"{dag_path}: its wasm modules come from different builds (some with --memory shared, some "
                          "without, or different shared plans); run 'cortex compile-wasm' again")
    return int(sizes.pop())


def open_wasm_device(dag: dict, dag_path: Path, limits: SandboxLimits | None = None) -> WasmDevice:
    """The device for the build dag.json records: one memory per CU, or one shared memory."""
    memory_bytes = shared_plan(dag, Path(dag_path))
    if memory_bytes is None:
        return WasmDevice(dag, dag_path, limits)
    return SharedMemoryDevice(dag, dag_path, limits, memory_bytes)


class SharedMemoryDevice(WasmDevice):
    concurrent_runs = False    # one Store for every CU: wasmtime forbids entering it from two threads at once

    def __init__(self, dag: dict, dag_path: Path, limits: SandboxLimits | None, memory_bytes: int):
        super().__init__(dag, dag_path, limits)
        self.pages = max(1, -(-memory_bytes // PAGE))
        self._new_store()

    def _new_store(self) -> None:
        self.store = wasmtime.Store(self.engine)
        self.store.set_limits(memory_size=self.pages * PAGE)
        self.store_generation += 1
        # Its maximum is its size: a module cannot grow the model's memory.
        self.memory = wasmtime.Memory(self.store, wasmtime.MemoryType(wasmtime.Limits(self.pages, self.pages)))

    def _instantiate(self, sandboxed: SandboxedCU, stamps: Stamps) -> WasmInstance:
        ticks = (deadline_ticks(sandboxed.deadline_ms), deadline_ticks(self.limits.cu_load_timeout_s * 1e3)) \
            if self.timed else (None, None)
        instance = WasmInstance(self.engine, sandboxed.module, sandboxed.plan, None, *ticks,
                                store=self.store, imports=(self.memory,))
        self.weights.write(self.store, self.memory, sandboxed.weights, sandboxed.cu_id, stamps)
        return instance

    def run(self, cu: dict, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        instance = self.instances.get(cu["id"]) or self._rebuild(cu)
        try:
            return instance.run(inputs)
        except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
            raise self.failed(cu, e, 0) from None    # the memory cannot grow

    def failed(self, cu: dict, error: Exception | None, grown: int) -> CortexError:
        sandboxed = self.sandboxed[cu["id"]]
        kind, message = failure(cu, error, 0, sandboxed.plan, sandboxed.deadline_ms)
        self.events.count(kind)
        try:
            self._rebuild_store()
        except CortexError as e:
            return CortexError(f"{message}; {e}")
        return CortexError(f"{message}; the model's shared memory was rebuilt (every CU instantiated again, its "
                           "weights written again)")

    def resident_bytes(self, cu_id: str) -> int:
        """The CU's region of the model memory, so that the CUs' figures add up to the memory once."""
        sandboxed = self.sandboxed.get(cu_id)
        return int(sandboxed.plan[SHARED]["region_bytes"]) if sandboxed is not None and cu_id in self.instances else 0

    def footprint(self, cu: dict) -> int:
        raise CortexError(f"{self.dag_path}: its CUs share one memory (compile-wasm --memory shared), which unloading a "
                          "CU does not shrink; a memory budget needs a build with --memory per-cu")

    def unload(self, cu_id: str) -> int:
        """The CU's instance goes; its region stays part of the model memory, so nothing is freed."""
        self.instances.pop(cu_id, None)
        self.sandboxed.pop(cu_id, None)
        return 0
