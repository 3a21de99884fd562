"""One linear memory per model (`compile-wasm --memory shared`): the model-level plan.

Each CU gets a region of its own in the model's memory, one after the other: its outputs, slots
for the inputs no other compiled CU writes (model inputs, outputs of a fallback CU), its weights
and its scratch, laid out as `memory_plan.place_storages` lays out a module of its own. A tensor
that crosses a CU border has one slot, the producer's output: the consumers' modules read it at
that address, so the runtime copies nothing between CUs (`shared_device.py`). Regions never
overlap, not even the scratch of CUs that can never run at the same time: sharing it is possible
but the plan stays simple until a measurement asks for it.

The plan needs every CU's region size before any module is rendered, so it lowers each CU's graph
once here (a pure function of the graph and the options), and each CU's build then lowers it again
with its `SharedLayout` and checks that it lands on the same region.
"""

from __future__ import annotations

import dataclasses

from backends.wasm.intrinsics import kernels as contraction_kernels
from backends.wasm.memory_plan import ALIGN
from backends.wasm.options import WasmOptions
from backends.wasm.shared_layout import SharedLayout
from codegen.lower import lower_graph
from codegen.memory_plan import aligned_size, place_temporaries
from ir.errors import CortexError, UnsupportedError
from ir.graph import Graph
from ir.loops.program import INPUT, OUTPUT, WEIGHT, Program

REGION_ALIGN = 64      # a region starts on a cache line, so two CUs never share one
MAX_MEMORY = 1 << 32   # what a wasm32 module can address


def place_in_region(program: Program, base: int, border_inputs: dict[str, int]) -> tuple[int, int]:
    """Offsets for every storage of `program` in the region that starts at `base`, except the
    inputs in `border_inputs`, which sit where their producer writes them; returns the region's
    bytes and the temporaries' arena within it."""
    input_names = {buf.storage: name for name, buf in program.inputs.items()}
    cursor = base
    for kind in (INPUT, OUTPUT, WEIGHT):
        for storage in program.storages:
            if storage.kind != kind:
                continue
            name = input_names.get(storage) if kind == INPUT else None
            if name in border_inputs:
                storage.offset = border_inputs[name]
                continue
            storage.offset = cursor
            cursor += aligned_size(storage.nbytes, ALIGN)
    arena = place_temporaries(program, ALIGN)
    for storage, offset in arena.offsets.items():
        storage.offset = cursor + offset
    return cursor + arena.arena_bytes - base, arena.arena_bytes


def place_shared(program: Program, layout: SharedLayout) -> int:
    """The CU's storages at their places in the model memory; returns its arena's bytes."""
    region, arena = place_in_region(program, layout.base, dict(layout.border_inputs))
    if region != layout.region_bytes:      # the plan and the build lowered the same graph differently
        raise RuntimeError(f"the shared-memory plan gave this CU {layout.region_bytes} bytes, its build needs {region}")
    return arena


def plan_shared_memory(options: WasmOptions, graphs: dict[str, Graph], manifest: dict) -> dict[str, WasmOptions]:
    """The options each compiled CU (`graphs`, by id, in manifest order) builds with: the model's
    options plus the CU's `SharedLayout`."""
    producer = {name: cu["id"] for cu in manifest["cus"] if cu["id"] in graphs for name in cu["outputs"]}
    by_id = {cu["id"]: cu for cu in manifest["cus"]}
    kernels = contraction_kernels(options)
    bases, regions, slots, cursor = {}, {}, {}, 0
    for cu_id, graph in graphs.items():
        border = {name: 0 for name in by_id[cu_id]["inputs"] if producer.get(name, cu_id) != cu_id}
        program = lower_graph(graph, kernels)
        regions[cu_id], _ = place_in_region(program, 0, border)
        slots[cu_id] = {name: buf.storage.offset for name, buf in program.outputs.items()}
        bases[cu_id] = cursor
        cursor += aligned_size(regions[cu_id], REGION_ALIGN)
    if cursor > MAX_MEMORY:
        raise UnsupportedError(f"--memory shared: the model's CUs need {cursor} bytes of memory together, more than "
                               f"the {MAX_MEMORY} a wasm32 memory can address; use --memory per-cu")
    planned = {}
    for cu_id in graphs:
        border = []
        for name in by_id[cu_id]["inputs"]:
            source = producer.get(name, cu_id)
            if source != cu_id:
                if name not in slots[source]:
                    raise CortexError(f"--memory shared: {name!r}, an input of {cu_id}, is not an output of {source}'s "
                                      "module; run 'cortex decompose' again")
                border.append((name, bases[source] + slots[source][name]))
        layout = SharedLayout(bases[cu_id], regions[cu_id], cursor, tuple(sorted(border)))
        planned[cu_id] = dataclasses.replace(options, shared_layout=layout)
    return planned
