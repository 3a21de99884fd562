"""A segment: several CUs of one store run by a single call into a generated driver module.

Calling a CU from Python costs a ctypes call, numpy views and bookkeeping: about a microsecond at
best, where a small CU's work is a fraction of that. Within a wasmtime store, one instance calls
another's exports directly, at the cost of a function call. So for a run of CUs that needs no host
decision (the scheduler's plan says which), the device generates a driver: a module that imports
each CU's `run` and memory and, in order,
- copies each input a CU of the segment produced from the producer's output slot into the
  reader's input slot (`memory.copy` between two memories: multi-memory; nothing when both are
  the same slot of the model's one memory, `--memory shared`);
- records which CU is about to run (the exported global `current`), then calls its `run`;
- checks that the CU left its memory at its planned size, else traps with `current` still naming it.

A trap therefore names its CU, as a call of one CU does, and the device's sandbox handles it as
its own (`failed`: counted, the store rebuilt, one line naming the CU and its ops). The deadline of
the call is the sum of its CUs' deadlines. A module may import at most 100 memories, so a long
segment is driven by several drivers, each over at most `MEMORIES_PER_DRIVER` memories, called in
order by one more module: the host still makes one call.

A process forked after the drivers were compiled (a server's worker) runs them, but compiles none:
wasmtime compiles on a pool of threads the child did not inherit, so a compile there would wait
forever. There a segment whose store was rebuilt runs its CUs one call each, and the device admits
no CU into a new segment (`joins_segment`).

Inputs from outside the segment (model inputs, other segments' outputs, cached tensors) are written
by the host into their readers' input slots before the call; every CU's outputs are handed on as
the views the CU's own call would have returned.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import wasmtime

from backends.wasm.direct_call import RunCall
from backends.wasm.instance import WasmInstance, in_place
from backends.wasm.sandbox import PAGE, deadline_ticks, planned_bytes
from ir.errors import CortexError

MEMORIES_PER_DRIVER = 96        # wasmtime validates at most 100 memories per module
NOT_RUNNING = -1


@dataclass(frozen=True)
class Copy:
    """One input of a segment's CU that an earlier CU of the segment produced."""
    reader: int         # position of the reading CU in the segment
    producer: int
    dst: int            # byte offsets in the reader's and the producer's memories
    src: int
    nbytes: int


def joins_segment(cu: dict) -> bool:
    """Whether a CU's module can run inside a segment. Not one with a bounded tensor (ir/bounds.py),
    which comes at its real length, written by the host beside it; nor one reading more tensors
    than a driver may import memories (a Concat of a hundred slices): each could come from a CU
    of its own, and one driver must reach all their memories and the reader's. Nor one whose
    contractions run as parts on threads (kernel_parts.py): its memory is a shared one, which its
    workers' stores import, not part of the segment's store."""
    plan = cu["artifacts"]["wasm"]["memory"]
    return (len(cu["inputs"]) < MEMORIES_PER_DRIVER and "threads" not in plan
            and not any("bound" in entry for entry in [*plan["inputs"], *plan["outputs"]]))


def segment_copies(instances: list[WasmInstance]) -> tuple[list[Copy], set[str]]:
    """The copies between the segment's CUs, and the tensors the host writes (read, not produced, inside)."""
    made_at: dict[str, tuple[int, dict]] = {}
    copies, external = [], set()
    for position, instance in enumerate(instances):
        for entry in instance.plan["inputs"]:
            name = entry["name"]
            if name not in made_at:
                external.add(name)
                continue
            producer, out = made_at[name]
            nbytes = math.prod(entry["shape"]) * np.dtype(entry["dtype"]).itemsize
            same_slot = instance.shares_memory and out["offset"] == entry["offset"]
            if not same_slot and nbytes:
                copies.append(Copy(position, producer, entry["offset"], out["offset"], nbytes))
        for entry in instance.plan["outputs"]:
            made_at[entry["name"]] = (position, entry)
    return copies, external


def driver_chunks(count: int, copies: list[Copy]) -> list[range]:
    """Consecutive runs of the segment's CUs, each touching at most MEMORIES_PER_DRIVER memories
    (its own CUs' and those of the producers it copies from)."""
    sources: dict[int, set[int]] = {}
    for c in copies:
        sources.setdefault(c.reader, set()).add(c.producer)
    chunks, start, touched = [], 0, set()
    for position in range(count):
        needs = {position} | sources.get(position, set())
        if position > start and len(touched | needs) > MEMORIES_PER_DRIVER:
            chunks.append(range(start, position))
            start, touched = position, set()
        touched |= needs
    chunks.append(range(start, count))
    return chunks


def driver_wat(chunk: range, copies: list[Copy], planned_pages: list[int] | None) -> tuple[str, list[int]]:
    """The driver of one chunk, and the CUs whose memories it imports, in import order. With
    `planned_pages` (memories of their own) it checks each CU's memory size after its call."""
    mine = [c for c in copies if c.reader in chunk]
    memories = sorted(set(chunk) | {c.producer for c in mine} | {c.reader for c in mine})
    index = {cu: i for i, cu in enumerate(memories)}
    lines = ["(module"]
    lines += [f'  (import "cu" "run{cu}" (func $run{cu}))' for cu in chunk]
    lines += [f'  (import "cu" "memory{cu}" (memory $m{index[cu]} 0))' for cu in memories]
    lines += [f'  (global $current (export "current") (mut i32) (i32.const {NOT_RUNNING}))',
              '  (func (export "run")']
    by_reader: dict[int, list[Copy]] = {}
    for c in mine:
        by_reader.setdefault(c.reader, []).append(c)
    for cu in chunk:
        for c in by_reader.get(cu, ()):
            lines.append(f"    (memory.copy $m{index[c.reader]} $m{index[c.producer]} (i32.const {_i32(c.dst)}) "
                         f"(i32.const {_i32(c.src)}) (i32.const {_i32(c.nbytes)}))")
        lines.append(f"    (global.set $current (i32.const {cu})) (call $run{cu})")
        if planned_pages is not None:
            lines.append(f"    (if (i32.gt_u (memory.size $m{index[cu]}) (i32.const {planned_pages[cu]})) "
                         "(then unreachable))")
    lines += [f"    (global.set $current (i32.const {NOT_RUNNING}))))"]
    return "\n".join(lines), memories


def _i32(value: int) -> int:
    """An unsigned 32-bit offset as the signed constant wasm text takes."""
    return value - (1 << 32) if value >= 1 << 31 else value


class WasmSegment:
    """The CUs `cus` (in order, loaded on `device`, which keeps them in one store) run in one call."""

    def __init__(self, device, cus: list[dict]):
        self.device = device
        self.cus = cus
        self.generation = -1      # the device's store this segment's drivers run in
        self._build()

    @staticmethod
    def compiles_here(device) -> bool:
        """Whether this process may compile drivers: the one that made the device's engine."""
        return os.getpid() == device.engine_pid

    def _build(self) -> None:
        device = self.device
        # A CU missing from the device (its store's rebuild failed) rebuilds the store, every
        # instance with it: then they are all read again, from the new store.
        generation = None
        while generation != device.store_generation:
            generation = device.store_generation
            instances = [device.instances.get(cu["id"]) or device._rebuild(cu) for cu in self.cus]
        store = device.store
        copies, external = segment_copies(instances)
        self._copied = [sum(c.nbytes for c in copies if c.reader == position) for position in range(len(instances))]
        own_memories = not instances[0].shares_memory
        pages = [planned_bytes(i.plan) // PAGE for i in instances] if own_memories else None
        drivers = []
        for chunk in driver_chunks(len(instances), copies):
            wat, memories = driver_wat(chunk, copies, pages)
            imports = [instances[cu]._run for cu in chunk] + [instances[cu].memory for cu in memories]
            drivers.append(wasmtime.Instance(store, wasmtime.Module(device.engine, wat), imports))
        self._currents = [d.exports(store)["current"] for d in drivers]
        run = drivers[0].exports(store)["run"]
        if len(drivers) > 1:
            top = "\n".join(["(module", *(f'  (import "driver" "run{i}" (func $d{i}))' for i in range(len(drivers))),
                             '  (func (export "run")', *(f"    (call $d{i})" for i in range(len(drivers))), "))"])
            run = wasmtime.Instance(store, wasmtime.Module(device.engine, top),
                                    [d.exports(store)["run"] for d in drivers]).exports(store)["run"]
        self._owners = drivers
        self._call = RunCall(store, run, instances[0].memory)
        self._store = store
        ms = [device.sandboxed[cu["id"]].deadline_ms for cu in self.cus]
        self._deadline = deadline_ticks(sum(ms)) if device.timed else None
        readers: dict[str, list[np.ndarray]] = {}
        for instance in instances:
            for name, view in instance.inputs.items():
                if name in external:
                    readers.setdefault(name, []).append(view)
        self.writes = [(name, view, instances[0].shares_memory) for name, views in readers.items() for view in views]
        self.outputs = {name: view for instance in instances for name, view in instance.outputs.items()}
        self.generation = device.store_generation

    def copied_bytes(self) -> list[int]:
        """Bytes the drivers copy into each CU's memory from the segment's other CUs, per call."""
        return list(self._copied)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Write the inputs from outside in, make the one call; every CU's outputs, as views (valid
        until these CUs run again)."""
        if self.generation != self.device.store_generation:
            if not self.compiles_here(self.device):
                return self._run_each(inputs)
            self._build()
        for name, view, shares in self.writes:
            value = inputs[name]
            if not (shares and in_place(value, view)):
                view[...] = value
        try:
            self._call(self._deadline)
        except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
            raise self._failed(e) from None
        return self.outputs

    def _run_each(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The segment's CUs with one call each: where no driver can be compiled."""
        env = dict(inputs)
        made = {}
        for cu in self.cus:
            outputs = self.device.run(cu, {name: env[name] for name in cu["inputs"]})
            env.update(outputs)
            made.update(outputs)
        return made

    def _failed(self, error: Exception) -> CortexError:
        """The device's error for the CU the drivers were running when the call failed."""
        position = next((p for p in (g.value(self._store) for g in self._currents) if p != NOT_RUNNING), None)
        if position is None:      # failed outside any CU: name the segment's first
            position = 0
        cu = self.cus[position]
        instance = self.device.instances[cu["id"]]
        return self.device.failed(cu, error, instance.memory_bytes())
