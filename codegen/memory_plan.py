"""Where the temporaries of a loop-nest program live: one arena, memory reused once a temporary is dead.

A program runs as a sequence of steps, each a list of statements that may touch a temporary in any
order (on a GPU, at the same time). A temporary lives from the first step that reads or writes it to
the last, both inclusive; two temporaries live at a common step never share a byte. The placement
is the project's greedy planner (`passes.plan_memory.plan_memory`), without in-place reuse: a
step may read an input after it wrote its output, so a dying input is not handed to its output.

What a step is belongs to the target. WebAssembly runs each node's kernel as one function call,
so the default steps are the kernels. CUDA runs a kernel as several launches and fuses several
kernels into one launch; it passes its launches, so that everything one launch touches is alive
together, whichever kernel of the launch touches it.

Sizes are rounded up to the alignment (an empty temporary still takes one aligned slot), so every
temporary starts on an alignment boundary and ends before the next one starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ir.loops.program import TEMP, Program, Stmt, Storage, buffers_accessed
from passes.plan_memory import Lifetime, plan_memory

Step = Sequence[Stmt]


@dataclass(frozen=True)
class ArenaPlan:
    offsets: dict[Storage, int]    # temporary -> byte offset within the arena
    arena_bytes: int
    lower_bound: int               # the most bytes live at one step: no placement needs less


def kernel_steps(program: Program) -> list[Step]:
    """One step per node kernel, in program order."""
    return [kernel.body for kernel in program.kernels]


def aligned_size(nbytes: int, alignment: int) -> int:
    return -(-max(nbytes, 1) // alignment) * alignment


def temp_lifetimes(program: Program, steps: Sequence[Step]) -> dict[Storage, tuple[int, int]]:
    """Temporary -> (first step, last step) that reads or writes it; untouched ones are absent."""
    temps = {s for s in program.storages if s.kind == TEMP}
    spans: dict[Storage, tuple[int, int]] = {}
    for index, step in enumerate(steps):
        for storage in {b.storage for b in buffers_accessed(step)} & temps:
            first, _ = spans.get(storage, (index, index))
            spans[storage] = (first, index)
    return spans


def place_temporaries(program: Program, alignment: int, steps: Sequence[Step] | None = None) -> ArenaPlan:
    """Offsets of every temporary of `program` in one arena, each a multiple of `alignment` (a power
    of two). `steps` default to the kernels; a temporary no step touches lives at step 0 only."""
    steps = kernel_steps(program) if steps is None else steps
    temps = [s for s in program.storages if s.kind == TEMP]
    spans = temp_lifetimes(program, steps)
    # Named by storage name: names are unique in a program, and the planner breaks ties by name,
    # so the placement does not depend on object identities.
    lifetimes = [Lifetime(s.name, aligned_size(s.nbytes, alignment), *spans.get(s, (0, 0)), alignment=alignment)
                 for s in temps]
    plan = plan_memory(lifetimes, in_place=False)
    return ArenaPlan({s: plan.offsets[s.name] for s in temps}, plan.arena_bytes, plan.lower_bound)
