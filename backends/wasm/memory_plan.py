"""Where each tensor of a computation unit lives in its module's linear memory.

Inputs, outputs and weights get fixed ranges (the host writes and reads the first two; the weights
are copied in once), each aligned to 16 bytes so SIMD loads never straddle a boundary they could
have avoided. Temporaries share one arena after them, placed by the target-neutral planner
(`codegen.memory_plan`) with each kernel one step: a temporary lives from the first kernel that
touches it to the last, and two temporaries alive in the same kernel never overlap. The renderer
only reads `Storage.offset`.
"""

from __future__ import annotations

from codegen.memory_plan import aligned_size, place_temporaries
from ir.errors import UnsupportedError
from ir.loops.program import INPUT, OUTPUT, TEMP, WEIGHT, Program

ALIGN = 16
_FIXED = (INPUT, OUTPUT, WEIGHT)


def place_storages(program: Program) -> tuple[int, int]:
    """Assign `offset` to every storage; return the bytes of memory the module needs and the
    size of the temporaries' arena within it."""
    cursor = 0
    for kind in _FIXED:
        for storage in program.storages:
            if storage.kind == kind:
                storage.offset = cursor
                cursor += aligned_size(storage.nbytes, ALIGN)
    plan = place_temporaries(program, ALIGN)
    for storage, offset in plan.offsets.items():
        storage.offset = cursor + offset
    cursor += plan.arena_bytes
    if cursor > 1 << 32:
        raise UnsupportedError(f"the computation unit needs {cursor} bytes of memory, more than the 4 GiB "
                               "a wasm32 module can address; split it with a smaller --max-cu-size")
    return cursor, plan.arena_bytes


def describe_plan(program: Program, memory_bytes: int, arena_bytes: int) -> dict:
    """The plan as recorded in dag.json: where the host writes inputs and reads outputs."""
    def entry(name, buf):
        found = {"name": name, "offset": buf.storage.offset, "bytes": buf.storage.nbytes,
                 "dtype": buf.dtype, "shape": list(buf.shape)}
        if name in program.bounds:     # a data-dependent length (ir/bounds.py)
            axis, companion = program.bounds[name]
            found["bound"] = {"axis": axis, "length_offset": companion.storage.offset}
        return found
    return {
        "memory_bytes": memory_bytes,
        "inputs": [entry(n, b) for n, b in program.inputs.items()],
        "outputs": [entry(n, b) for n, b in program.outputs.items()],
        "weights_bytes": sum(s.nbytes for s in program.storages if s.kind == WEIGHT),
        "temp_bytes": sum(s.nbytes for s in program.storages if s.kind == TEMP),
        "temp_arena_bytes": arena_bytes,
    }
