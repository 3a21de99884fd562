"""The wasm device: runs CUs compiled by `cortex compile-wasm` under wasmtime.

One wasmtime Engine, configured with the features the modules were built with, serves every CU.
`load` checks each module's sha256 against dag.json (a tampered or stale file is refused) and
instantiates it from its cached native code (`native_cache`). `unload` drops a CU's store and
instance, so its linear memory is released; its compiled module stays, so the CU is back to warm
and loading it again is one instantiation (its weights mapped or read in again), no file mapped or
hashed. Running copies a CU's inputs into
its memory, makes one call, and hands its outputs on as zero-copy views of that memory, valid until
the CU runs again; `to_host` copies them out.

Each CU runs in its own sandbox (`sandbox`): its store has a memory limit from its plan, each call
a deadline, each load a timeout. A call that traps, times out or grows its memory fails with one
line naming the CU and its ops, and that CU's store is rebuilt from its module (already compiled),
so the next request runs on a fresh instance; `sandbox_events` counts all of it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import wasmtime

from backends.limits import SandboxLimits
from backends.registry import HostTensors
from backends.wasm.assemble import make_engine
from backends.wasm.instance import WasmInstance, in_place
from backends.wasm.kernel_threads import KernelThreads, new_shared_memory
from backends.wasm.native_cache import CacheWrites, Stamps, load_module
from backends.wasm.options import WasmOptions, parse_options
from backends.wasm.prefault import prefault
from backends.wasm.sandbox import (
    TICKER,
    SandboxEvents,
    deadline_ms,
    deadline_ticks,
    failure,
    load_within,
    memory_limit,
    planned_bytes,
    trap_reason,
)
from backends.wasm.segment import WasmSegment, joins_segment
from backends.wasm.weights_files import WeightLoader
from ir.errors import CortexError
from ir.fs import confined_path

EPOCH_ENGINE_TAG = ":epoch-interruption"


@dataclass
class SandboxedCU:
    """What rebuilding a CU's store needs: its compiled module, plan, call deadline and the weight
    files written into its memory (compile-wasm --external-weights)."""
    cu_id: str
    module: wasmtime.Module
    plan: dict
    deadline_ms: float | None
    weights: list[dict]
    planned_bytes: int = field(init=False)     # checked after every call: computed once

    def __post_init__(self):
        self.planned_bytes = planned_bytes(self.plan)


class WasmDevice(HostTensors):
    name = "wasm"
    concurrent_runs = True   # one store per instance, and wasmtime's engine and modules are shared safely between threads

    def __init__(self, dag: dict, dag_path: Path, limits: SandboxLimits | None = None):
        self.dag_path = Path(dag_path)
        for cu in dag["cus"]:
            if "wasm" not in cu.get("artifacts", {}):
                raise CortexError(f"{dag_path}: {cu['id']} has no wasm artifact; run 'cortex compile-wasm "
                                  f"--dag {dag_path}' first")
        self.options = _common_options([cu["artifacts"]["wasm"] for cu in dag["cus"]], self.dag_path)
        self.limits = limits or SandboxLimits()
        self.timed = self.limits.timed      # no time limit: no epoch checks compiled in
        self.engine = make_engine(self.options, epoch_interruption=self.timed, segments=True)
        self.engine_pid = os.getpid()     # a forked child compiles nothing with it (backends/wasm/segment.py)
        if self.timed:
            TICKER.add(self.engine)
        self.instances: dict[str, WasmInstance] = {}
        self.sandboxed: dict[str, SandboxedCU] = {}
        self.events = SandboxEvents()
        self.weights = WeightLoader(self.dag_path.parent, self.dag_path)
        # Reloads trust a weight file an earlier load verified while its identity is unchanged:
        # one Stamps for the device's life, so a reload reads no stamp file.
        self._reload_stamps = Stamps()
        # One store for every CU (`join_one_store`), so that a segment runs several in one call;
        # None: each CU in a store of its own. `store_generation` counts the stores made, so that
        # segments built on an earlier one know to build again.
        self.store: wasmtime.Store | None = None
        self.store_generation = 0
        self._memory_ceiling = max((memory_limit(cu["artifacts"]["wasm"]["memory"]) for cu in dag["cus"]), default=0)
        # Threads per CU for the contractions a module splits into parts (`--features threads`):
        # the caller's and kernel_threads - 1 workers of its own (`use_kernel_threads`).
        self.kernel_threads = 1
        self.workers: dict[str, KernelThreads] = {}
        # A model dropped without close(): its CUs' workers are stopped when the device goes. At
        # exit they are left alone (daemon threads, parked), so exit never waits on a store.
        weakref.finalize(self, _close_all, self.workers).atexit = False

    def use_kernel_threads(self, count: int) -> None:
        """Run each split contraction on `count` threads (the calling one included); from the next load."""
        self.kernel_threads = max(1, int(count))

    def join_one_store(self) -> None:
        """From now on the CUs this device loads share one store, which segments need: a call can
        cross from one instance into another only within a store. Called before `load`. Threads
        cannot share a store, so only a sequential walk asks for it.
        What changes: the store's memory limit is the largest CU's (each CU's own limit is checked
        after its call, by the device or by the segment's driver, as before), and a trap or a timeout
        rebuilds the whole store, every loaded CU instantiated again."""
        if self.store is None:
            self.concurrent_runs = False
            self._new_store()

    def _new_store(self) -> None:
        self.store = wasmtime.Store(self.engine)
        self.store.set_limits(memory_size=self._memory_ceiling)
        self.store_generation += 1

    def load(self, cus: list[dict]) -> None:
        wanted = {cu["id"]: cu for cu in cus}
        for cu_id in wanted:
            if cu_id in self.sandboxed and cu_id not in self.instances:
                self._reload(cu_id)
        stamps, writes = Stamps(), CacheWrites()
        todo = [cu for cu in wanted.values() if cu["id"] not in self.sandboxed]
        if not todo:
            return
        loaded = load_within(todo, lambda cu: self._load_one(cu, stamps, writes), self.limits.cu_load_timeout_s,
                             writes.abandon)
        for cu_id, (sandboxed, instance) in loaded.items():
            self.sandboxed[cu_id], self.instances[cu_id] = sandboxed, instance
        stamps.save()

    def _load_one(self, cu: dict, stamps: Stamps, writes: CacheWrites) -> tuple[SandboxedCU, WasmInstance]:
        record = cu["artifacts"]["wasm"]
        path = confined_path(self.dag_path.parent, record["path"])   # read_dag checked it stays inside
        module = load_module(self.engine, path, record["sha256"], self.dag_path, cu["id"], stamps,
                             EPOCH_ENGINE_TAG if self.timed else "", writes)
        sandboxed = SandboxedCU(cu["id"], module, record["memory"],
                                deadline_ms(cu, record["memory"], self.limits) if self.timed else None,
                                list(record.get("weights", ())))
        try:
            return sandboxed, self._instantiate(sandboxed, stamps)
        except (wasmtime.WasmtimeError, wasmtime.Trap) as e:
            raise CortexError(f"{path}: {cu['id']} cannot be instantiated under its memory limit of "
                              f"{memory_limit(record['memory'])} bytes and its load timeout: {trap_reason(e)}") from None

    def _instantiate(self, sandboxed: SandboxedCU, stamps: Stamps) -> WasmInstance:
        threads = sandboxed.plan.get("threads")
        if threads is not None:
            return self._instantiate_threaded(sandboxed, threads, stamps)
        if self.store is not None:
            if memory_limit(sandboxed.plan) > self._memory_ceiling:     # a variant's module may plan more
                self._memory_ceiling = memory_limit(sandboxed.plan)
                self.store.set_limits(memory_size=self._memory_ceiling)
            ticks = (deadline_ticks(sandboxed.deadline_ms), deadline_ticks(self.limits.cu_load_timeout_s * 1e3)) \
                if self.timed else (None, None)
            instance = WasmInstance(self.engine, sandboxed.module, sandboxed.plan, None, *ticks, store=self.store)
        elif not self.timed:
            instance = WasmInstance(self.engine, sandboxed.module, sandboxed.plan, memory_limit(sandboxed.plan))
        else:
            # The start function is part of the load, so it gets the load's time limit.
            instance = WasmInstance(self.engine, sandboxed.module, sandboxed.plan, memory_limit(sandboxed.plan),
                                    deadline_ticks(sandboxed.deadline_ms),
                                    deadline_ticks(self.limits.cu_load_timeout_s * 1e3))
        # Every fresh store, a rebuilt one included, starts with zeroed memory: the weights go in each time.
        self.weights.write(instance.store, instance.memory, sandboxed.weights, sandboxed.cu_id, stamps)
        return instance

    def _instantiate_threaded(self, sandboxed: SandboxedCU, threads: dict, stamps: Stamps) -> WasmInstance:
        """A module with split contractions: its shared memory, its caller's instance in a store of
        its own (never the segments' one store: it runs on its own), and its workers."""
        self._close_workers(sandboxed.cu_id)
        memory = new_shared_memory(self.engine, threads["pages"])
        ticks = (deadline_ticks(sandboxed.deadline_ms), deadline_ticks(self.limits.cu_load_timeout_s * 1e3)) \
            if self.timed else (None, None)
        instance = WasmInstance(self.engine, sandboxed.module, sandboxed.plan, None, *ticks, imports=(memory,))
        self.weights.write(instance.store, instance.memory, sandboxed.weights, sandboxed.cu_id, stamps)
        self._start_workers(sandboxed, instance)
        return instance

    def _start_workers(self, sandboxed: SandboxedCU, instance: WasmInstance) -> None:
        """The CU's worker threads, each instantiating its module against the CU's shared memory
        (its weights written again: the same bytes), before a call, never during one."""
        stop = instance.exports["stop"]
        self.workers[sandboxed.cu_id] = KernelThreads(self.engine, sandboxed.module,
                                            instance.threaded_memory, instance.plan["threads"]["control"],
                                            self.kernel_threads, self.timed, lambda: stop(instance.store))

    def _close_workers(self, cu_id: str) -> None:
        workers = self.workers.pop(cu_id, None)
        if workers is not None:
            workers.close()

    def close_kernel_threads(self) -> None:
        """Stop every CU's worker threads; a CU's next call starts them again."""
        _close_all(self.workers)

    def run(self, cu: dict, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        instance = self.instances.get(cu["id"]) or self._rebuild(cu)
        if instance.threaded_memory is not None and cu["id"] not in self.workers:
            self._start_workers(self.sandboxed[cu["id"]], instance)
        try:
            outputs = instance.run(inputs)
            error = None
        except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
            error = e
        sandboxed = self.sandboxed[cu["id"]]
        grown = instance.memory_size if error is None else instance.memory_bytes()   # run() just read it
        if error is None and grown <= sandboxed.planned_bytes:
            return outputs
        raise self.failed(cu, error, grown)

    def failed(self, cu: dict, error: Exception | None, grown: int) -> CortexError:
        """The error for a call of `cu` that trapped (`error`) or grew its memory to `grown` bytes,
        counted, after the store it ran in was rebuilt: the failed store may hold any state the
        module left, so the next call gets a fresh one."""
        sandboxed = self.sandboxed[cu["id"]]
        kind, message = failure(cu, error, grown, sandboxed.plan, sandboxed.deadline_ms)
        self.events.count(kind)
        workers = self.workers.get(cu["id"])
        worker_failure = workers.failure() if workers is not None else None
        if worker_failure is not None:      # the caller trapped because a worker did: say why
            message = f"{cu['id']} ({', '.join(cu.get('op_types', [])) or 'no ops'}) failed: {worker_failure}"
        try:
            if self.store is None or cu["id"] in self.workers:
                self._close_workers(cu["id"])
                self.instances.pop(cu["id"], None)
                self._rebuild(cu)
            else:
                self._rebuild_store()
                message += "; the model's store was rebuilt (every CU instantiated again, its weights written again)"
        except CortexError as e:
            return CortexError(f"{message}; {e}")
        return CortexError(message)

    def _rebuild_store(self) -> None:
        """A fresh store, every loaded CU instantiated in it from its compiled module."""
        self.instances.clear()     # views of the old memories go with the old store
        try:
            self._new_store()
            stamps = Stamps()
            for cu_id, sandboxed in self.sandboxed.items():
                self.instances[cu_id] = self._instantiate(sandboxed, stamps)
        except (wasmtime.WasmtimeError, wasmtime.Trap) as e:
            self.instances.clear()
            raise CortexError(f"rebuilding the model's store failed ({trap_reason(e)}); "
                              "the next request tries again") from None
        self.events.count("rebuilt")

    def _rebuild(self, cu: dict) -> WasmInstance:
        """A fresh store and instance of a loaded CU, from its compiled module (no file is read)."""
        if self.store is not None and "threads" not in self.sandboxed[cu["id"]].plan:
            self._rebuild_store()
            return self.instances[cu["id"]]
        try:
            instance = self.instances[cu["id"]] = self._instantiate(self.sandboxed[cu["id"]], Stamps())
        except (wasmtime.WasmtimeError, wasmtime.Trap) as e:
            raise CortexError(f"rebuilding {cu['id']}'s store failed ({trap_reason(e)}); "
                              "the next request tries again") from None
        self.events.count("rebuilt")
        return instance

    def output_owner(self, cu_id: str) -> object | None:
        """What keeps the memory of the CU's outputs (views) alive: its store. None where other CUs
        may write those slots (the model's one memory, `--memory shared`, reuses them as soon as
        their readers ran), and for a bounded CU, whose outputs are cut from their slots."""
        instance = self.instances.get(cu_id)
        if instance is None or instance.lengths or instance.shares_memory:
            return None
        return instance.store

    def joins_segment(self, cu: dict) -> bool:
        """Whether `cu` may run inside a segment (`segment`): only within one store."""
        return self.store is not None and joins_segment(cu) and WasmSegment.compiles_here(self)

    def segment(self, cus: list[dict]) -> WasmSegment:
        """The loaded CUs `cus`, in order, run by one call (backends/wasm/segment.py)."""
        return WasmSegment(self, cus)

    def reads_in_place(self, cu: dict, name: str, tensor) -> bool:
        """Whether running `cu` reads its input `name` where `tensor` already lies, copying nothing
        (a producer's output slot in the model's shared memory); with memories of their own, never."""
        instance = self.instances.get(cu["id"])
        return (instance is not None and instance.shares_memory and name in instance.inputs
                and in_place(tensor, instance.inputs[name]))

    def sandbox_events(self) -> dict[str, int]:
        return dict(self.events.counts)

    def resident_bytes(self, cu_id: str) -> int:
        instance = self.instances.get(cu_id)
        return instance.memory_size if instance else 0     # read after its last call: only a call grows it

    def footprint(self, cu: dict) -> int:
        """The module's planned memory, in whole wasm pages: what `resident_bytes` reports once loaded."""
        return planned_bytes(cu["artifacts"]["wasm"]["memory"])

    def unload(self, cu_id: str) -> int:
        """Back to warm: the store and the instance go, its memory with them; the compiled module
        stays (a few KB of native code, mapped), so loading it again is `_reload`."""
        freed = self.resident_bytes(cu_id)
        self._close_workers(cu_id)
        self.instances.pop(cu_id, None)
        return freed

    def _reload(self, cu_id: str) -> None:
        """An unloaded CU instantiated again from its kept module: no file is read or hashed but
        its weight files (`compile-wasm --external-weights`), each one copy into the new memory;
        embedded weights are mapped copy-on-write again."""
        sandboxed = self.sandboxed[cu_id]
        try:
            self.instances[cu_id] = self._instantiate(sandboxed, self._reload_stamps)
        except (wasmtime.WasmtimeError, wasmtime.Trap) as e:
            raise CortexError(f"{cu_id} cannot be instantiated again under its memory limit of "
                              f"{memory_limit(sandboxed.plan)} bytes and its load timeout: {trap_reason(e)}") from None
        self._reload_stamps.save()

    def prefault(self, cu_id: str) -> None:
        """The loaded CU's memory faulted in now (`prefault.py`), so its first call does not take
        the page faults: the memory budget's loader calls it on its own thread."""
        instance = self.instances.get(cu_id)
        # A threaded CU's shared memory was written whole at load (its workers wrote it again).
        if instance is not None and not instance.shares_memory and instance.threaded_memory is None:
            prefault(instance.store, instance.memory, self.sandboxed[cu_id].plan)


def _close_all(workers: dict[str, KernelThreads]) -> None:
    for cu_id in list(workers):
        workers.pop(cu_id).close()


def _common_options(records: list[dict], dag_path: Path) -> WasmOptions:
    """One engine for all modules: it enables the union of the features they were built with."""
    features = sorted({f for r in records for f in r["options"]["features"]})
    target = records[0]["options"].get("target") if records else None
    try:
        return parse_options(target, ",".join(features), None)
    except CortexError as e:
        raise CortexError(f"{dag_path}: wasm artifacts record unusable options: {e}") from None
