"""Fusing consecutive elementwise kernels of a CU into one launch.

Two pure map nests (thread loops only, no accumulators) over the same thread count fuse when the
second reads what the first wrote only at the cell the same thread wrote, and writes nothing the
first reads or writes: then running both bodies in one thread, one after the other, is what two
launches in stream order compute. A chain Add -> Relu -> Mul becomes one kernel; the intermediate
tensors are still written (a later CU or node may read them) but not re-read from another launch.

A tiled contraction (`tiled`) heads a group the same way: its threads are its output cells, so the
maps that follow under the same rule become its epilogue, applied by each output's thread right
after it stores the finished sum (MatMul + bias Add + Relu, Conv + per-channel Add + Relu...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from codegen.affine import affine
from ir.loops.program import Assign, Kernel, Stmt, Store, loads_in, walk_stmts

from codegen.parallel_loops import ParallelNest
from backends.cuda.tiled import plan_tiled


@dataclass
class Unit:
    """One launch to be: a nest (or serial statements) of one node's kernel."""
    name: str
    kernel: Kernel
    nest: ParallelNest | None
    stmts: list[Stmt]
    fused: list["Unit"] = field(default_factory=list)   # later units folded into this launch

    @property
    def parts(self) -> list["Unit"]:
        return [self, *self.fused]


def _is_pure_map(unit: Unit) -> bool:
    nest = unit.nest
    return (nest is not None and not nest.serial
            and not any(isinstance(s, Assign) for s in walk_stmts(nest.body)))


def _can_head(unit: Unit, epilogues: bool) -> bool:
    """A group may start here: a pure map, or a tiled contraction whose epilogue the maps become."""
    return _is_pure_map(unit) or (epilogues and plan_tiled(unit.nest) is not None)


def _canonical(unit: Unit) -> tuple[list[int], dict[int, int]]:
    """The extents of the thread loops that iterate (more than once), and uid -> position."""
    loops = [loop for loop in unit.nest.threads if loop.extent > 1]
    positions = {loop.var.uid: -1 for loop in unit.nest.threads if loop.extent == 1}   # always 0
    positions.update({loop.var.uid: k for k, loop in enumerate(loops)})
    return [loop.extent for loop in loops], positions


def _form(index, positions: dict[int, int], extents: list[int]):
    """How a cell is addressed from the thread coordinates. The row-major index of the thread's
    own flat position is the same cell under any split of the same thread count (an Add over
    [74, 45] and a Relu over [3330] write the same cell from the same flat thread), so it gets one
    name; other forms are compared only between nests with the same extents."""
    form = affine(index)
    if form is None or any(uid not in positions for uid in form[0]):
        return None
    terms = tuple(sorted((positions[uid], c) for uid, c in form[0].items() if positions[uid] >= 0 and c != 0))
    stride, row_major = 1, []
    for position in reversed(range(len(extents))):
        row_major.append((position, stride))
        stride *= extents[position]
    if form[1] == 0 and terms == tuple(sorted(row_major)):
        return "row-major"
    return tuple(extents), terms, form[1]


def _accesses(unit: Unit):
    body = unit.nest.body
    stores = [(s.buffer.storage, s.index) for s in walk_stmts(body) if isinstance(s, Store)]
    loads = [(x.buffer.storage, x.index) for x in loads_in(body)]
    return stores, loads


def fuse_elementwise(units: list[Unit], epilogues: bool = True) -> list[Unit]:
    """`epilogues=False`: maps never join a tiled contraction (the renderer's option, which must be
    off whenever tiling is, since only a tiled launch can run an epilogue)."""
    out: list[Unit] = []
    written: dict[int, object] = {}     # storage id -> canonical store form, for the open group
    read: set[int] = set()
    extents: list[int] | None = None
    for unit in units:
        head = out[-1] if out else None
        if head is not None and _can_head(head, epilogues) and _is_pure_map(unit) and _can_join(unit, extents, written, read):
            head.fused.append(unit)
        else:
            out.append(unit)
            written, read, extents = {}, set(), None
            if not _can_head(unit, epilogues) or not _record(unit, written, read):
                written, read = {"closed": None}, set()
                continue
        extents = _canonical(unit)[0]
    return out


def _record(unit: Unit, written: dict, read: set) -> bool:
    extents, positions = _canonical(unit)
    stores, loads = _accesses(unit)
    for storage, index in stores:
        form = _form(index, positions, extents)
        if form is None or written.get(id(storage), form) != form:
            return False
        written[id(storage)] = form
    read.update(id(storage) for storage, _ in loads)
    return True


def _can_join(unit: Unit, extents, written: dict, read: set) -> bool:
    if "closed" in written or extents is None:
        return False
    mine, positions = _canonical(unit)
    if math.prod(mine) != math.prod(extents):
        return False
    stores, loads = _accesses(unit)
    if any(id(storage) in written or id(storage) in read for storage, _ in stores):
        return False
    for storage, index in loads:
        if id(storage) in written and _form(index, positions, mine) != written[id(storage)]:
            return False
    new_written, new_read = dict(written), set(read)
    if not _record(unit, new_written, new_read):
        return False
    written.update(new_written)
    read.update(new_read)
    return True
