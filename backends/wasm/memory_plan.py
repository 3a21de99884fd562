"""Where each tensor of a computation unit lives in its module's linear memory.

A bump allocator: inputs first, then outputs, weights and temporaries, each aligned to 16 bytes so
SIMD loads never straddle an alignment boundary they could have avoided. Every buffer gets its own
range (no reuse yet), which is simple and obviously correct; the arena planner that reuses dead
temporaries' space can replace `plan_memory` without touching the renderer, which only reads
`Storage.offset`.
"""

from __future__ import annotations

from ir.loops.program import INPUT, OUTPUT, TEMP, WEIGHT, Program

ALIGN = 16
_ORDER = (INPUT, OUTPUT, WEIGHT, TEMP)


def plan_memory(program: Program) -> int:
    """Assign `offset` to every storage; return the bytes of memory the module needs."""
    cursor = 0
    for kind in _ORDER:
        for storage in program.storages:
            if storage.kind == kind:
                storage.offset = cursor
                cursor += -(-max(storage.nbytes, 1) // ALIGN) * ALIGN
    if cursor > 1 << 32:
        from ir.errors import UnsupportedError
        raise UnsupportedError(f"the computation unit needs {cursor} bytes of memory, more than the 4 GiB "
                               "a wasm32 module can address; split it with a smaller --max-cu-size")
    return cursor


def describe_plan(program: Program, memory_bytes: int) -> dict:
    """The plan as recorded in dag.json: where the host writes inputs and reads outputs."""
    def entry(name, buf):
        return {"name": name, "offset": buf.storage.offset, "bytes": buf.storage.nbytes,
                "dtype": buf.dtype, "shape": list(buf.shape)}
    return {
        "memory_bytes": memory_bytes,
        "inputs": [entry(n, b) for n, b in program.inputs.items()],
        "outputs": [entry(n, b) for n, b in program.outputs.items()],
        "weights_bytes": sum(s.nbytes for s in program.storages if s.kind == WEIGHT),
        "temp_bytes": sum(s.nbytes for s in program.storages if s.kind == TEMP),
    }
