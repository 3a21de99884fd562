"""Faulting a fresh instance's memory in before its first call, on the thread that loaded it.

A fresh instance's linear memory is mapped but not yet backed: its first call takes a page fault
for each 4 KiB it touches, zero-filling the temporaries' arena and mapping the weights' pages
(an embedded data segment is mapped copy-on-write from the native-code cache). Under a memory
budget every CU is loaded again on each request, so those faults, about a tenth of vgg19's compute
at a quarter budget, land on the thread that runs the CUs unless the loader takes them first.

`prefault` asks the kernel to take them at once (madvise MADV_POPULATE_READ / _WRITE, Linux 5.14
and later; ctypes releases the GIL meanwhile): the weights' range readable, so a copy-on-write
page is mapped from the page cache rather than copied, the rest writable. Elsewhere, or on an
older kernel, it does nothing and the first call faults as before. Only the time moves: the pages
it populates are the module's planned memory, which its calls touch anyway.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import wasmtime

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23     # linux/mman.h


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise()


def prefault(store: wasmtime.Store, memory: wasmtime.Memory, plan: dict) -> None:
    """Populate the pages of `memory`, laid out by the memory plan `plan` (inputs, outputs, weights,
    then the temporaries' arena: backends/wasm/memory_plan.py)."""
    if _MADVISE is None:
        return
    size = memory.data_len(store)
    base = ctypes.cast(memory.data_ptr(store), ctypes.c_void_p).value
    if not size or base is None or base % mmap.PAGESIZE:
        return
    arena = min(size, max(0, plan["memory_bytes"] - plan.get("temp_arena_bytes", 0)))
    weights = max(0, arena - plan.get("weights_bytes", 0))
    page = mmap.PAGESIZE
    start, end = weights // page * page, -(-arena // page) * page
    for advice, low, high in ((MADV_POPULATE_WRITE, 0, start), (MADV_POPULATE_READ, start, end),
                              (MADV_POPULATE_WRITE, end, size)):
        if high > low and _MADVISE(base + low, high - low, advice) != 0:
            return      # EINVAL: a kernel without populate; the first call faults them instead
