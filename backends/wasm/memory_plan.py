"""Where each tensor of a computation unit lives in its module's linear memory.

Inputs, outputs and weights get fixed ranges (the host writes and reads the first two; the weights
are copied in once), each aligned to 16 bytes so SIMD loads never straddle a boundary they could
have avoided. Temporaries share one arena after them, placed by the project's planner
(`passes.plan_memory`): a temporary lives from the first kernel that touches it to the last, and
two temporaries alive in the same kernel never overlap. The renderer only reads `Storage.offset`.
"""

from __future__ import annotations

from ir.errors import UnsupportedError
from ir.loops.program import INPUT, OUTPUT, TEMP, WEIGHT, Program, buffers_accessed
from passes.plan_memory import Buffer as Lifetime
from passes.plan_memory import plan_memory as place_buffers

ALIGN = 16
_FIXED = (INPUT, OUTPUT, WEIGHT)


def plan_memory(program: Program) -> tuple[int, int]:
    """Assign `offset` to every storage; return the bytes of memory the module needs and the
    size of the temporaries' arena within it."""
    cursor = 0
    for kind in _FIXED:
        for storage in program.storages:
            if storage.kind == kind:
                storage.offset = cursor
                cursor += _aligned(storage.nbytes)
    temps = [s for s in program.storages if s.kind == TEMP]
    lifetimes = _temp_lifetimes(program, {id(s) for s in temps})
    plan = place_buffers([Lifetime(s.name, _aligned(s.nbytes), *lifetimes.get(id(s), (0, 0)), alignment=ALIGN)
                          for s in temps], in_place=False)
    for s in temps:
        s.offset = cursor + plan.offsets[s.name]
    cursor += plan.arena_bytes
    if cursor > 1 << 32:
        raise UnsupportedError(f"the computation unit needs {cursor} bytes of memory, more than the 4 GiB "
                               "a wasm32 module can address; split it with a smaller --max-cu-size")
    return cursor, plan.arena_bytes


def _aligned(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN


def _temp_lifetimes(program: Program, temp_ids: set[int]) -> dict[int, tuple[int, int]]:
    """Storage id -> (first kernel, last kernel) that reads or writes it."""
    spans: dict[int, tuple[int, int]] = {}
    for step, kernel in enumerate(program.kernels):
        for storage_id in {id(b.storage) for b in buffers_accessed(kernel.body)}:
            if storage_id in temp_ids:
                first, _ = spans.get(storage_id, (step, step))
                spans[storage_id] = (first, step)
    return spans


def describe_plan(program: Program, memory_bytes: int, arena_bytes: int) -> dict:
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
        "temp_arena_bytes": arena_bytes,
    }
