"""Fusing consecutive elementwise kernels of a CU into one launch.

Two pure map nests (thread loops only, no accumulators) over the same thread extents fuse when the
second reads what the first wrote only at the cell the same thread wrote, and writes nothing the
first reads or writes: then running both bodies in one thread, one after the other, is what two
launches in stream order compute. A chain Add -> Relu -> Mul becomes one kernel; the intermediate
tensors are still written (a later CU or node may read them) but not re-read from another launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ir.loops.expr import Load, walk
from ir.loops.program import Assign, Kernel, Stmt, Store, walk_stmts

from backends.cuda.parallelize import ParallelNest, affine


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


def _canonical(unit: Unit) -> tuple[list[int], dict[int, int]]:
    """The extents of the thread loops that iterate (more than once), and uid -> position."""
    loops = [loop for loop in unit.nest.threads if loop.extent > 1]
    return [loop.extent for loop in loops], {loop.var.uid: k for k, loop in enumerate(loops)}


def _form(index, positions: dict[int, int]):
    form = affine(index)
    if form is None or any(uid not in positions for uid in form[0]):
        return None
    return tuple(sorted((positions[uid], c) for uid, c in form[0].items())), form[1]


def _accesses(unit: Unit):
    stores, loads = [], []
    for s in walk_stmts(unit.nest.body):
        exprs = []
        if isinstance(s, Store):
            stores.append((s.buffer.storage, s.index))
            exprs = [s.index, s.value]
        elif hasattr(s, "cond"):
            exprs = [s.cond]
        loads += [(x.buffer.storage, x.index) for e in exprs for x in walk(e) if isinstance(x, Load)]
    return stores, loads


def fuse_elementwise(units: list[Unit]) -> list[Unit]:
    out: list[Unit] = []
    written: dict[int, object] = {}     # storage id -> canonical store form, for the open group
    read: set[int] = set()
    extents: list[int] | None = None
    for unit in units:
        head = out[-1] if out else None
        if head is not None and _is_pure_map(head) and _is_pure_map(unit) and _can_join(unit, extents, written, read):
            head.fused.append(unit)
        else:
            out.append(unit)
            written, read, extents = {}, set(), None
            if not _is_pure_map(unit) or not _record(unit, written, read):
                written, read = {"closed": None}, set()
                continue
        extents = _canonical(unit)[0]
    return out


def _record(unit: Unit, written: dict, read: set) -> bool:
    _, positions = _canonical(unit)
    stores, loads = _accesses(unit)
    for storage, index in stores:
        form = _form(index, positions)
        if form is None or written.get(id(storage), form) != form:
            return False
        written[id(storage)] = form
    read.update(id(storage) for storage, _ in loads)
    return True


def _can_join(unit: Unit, extents, written: dict, read: set) -> bool:
    if "closed" in written or extents is None:
        return False
    mine, positions = _canonical(unit)
    if mine != extents:
        return False
    stores, loads = _accesses(unit)
    if any(id(storage) in written or id(storage) in read for storage, _ in stores):
        return False
    for storage, index in loads:
        if id(storage) in written and _form(index, positions) != written[id(storage)]:
            return False
    new_written, new_read = dict(written), set(read)
    if not _record(unit, new_written, new_read):
        return False
    written.update(new_written)
    read.update(new_read)
    return True
