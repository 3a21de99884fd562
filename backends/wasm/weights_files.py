"""Weights outside the module: content-addressed files the device writes into a CU's memory.

With `--external-weights` (always on for shape specializations) a module carries no data segments.
Each weight storage becomes `weights/<sha256>.bin`, named by its bytes, and the record lists where
it goes (`artifacts.wasm.weights`: file, memory offset, bytes, sha256). Builds that hold the same
weights (the same CU compiled for several input shapes, a weight repeated in one model) therefore
store it once, and a module whose code is identical across shapes is one `modules/<sha256>.wasm`.
At load each file is read straight into the memory at its offset and its sha256 checked against
the record (a warm load trusts a file its stamps vouch for, as it trusts the modules): one copy per
load, where embedded active segments are mapped copy-on-write from the native-code cache, which is
why embedding stays the default for single-shape builds (docs/runtime.md measures both).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import wasmtime

from backends.wasm.native_cache import Stamps, remember, trusted
from ir.errors import CortexError
from ir.fs import confined_path, sha256_bytes
from ir.loops.program import WEIGHT, Program

WEIGHTS_FOLDER = "weights"
MODULES_FOLDER = "modules"


def weight_segments(program: Program) -> list[tuple[int, bytes]]:
    """(offset, bytes) of every non-empty weight storage, in the plan's order."""
    return [(s.offset, bytes(s.data)) for s in program.storages if s.kind == WEIGHT and s.nbytes]


def weight_files(segments: list[tuple[int, bytes]]) -> tuple[dict[str, bytes], list[dict]]:
    """The files (name -> bytes) and the record's entries for `segments`."""
    files, entries = {}, []
    for offset, data in segments:
        digest = sha256_bytes(data)
        name = f"{WEIGHTS_FOLDER}/{digest}.bin"
        files[name] = data
        entries.append({"file": name, "offset": offset, "bytes": len(data), "sha256": digest})
    return files, entries


class WeightLoader:
    """Reads a record's weight files straight into an instance's memory. A file is hashed after
    reading unless the load's stamps say an earlier load verified this very file (its size, inode
    and timestamps unchanged: `native_cache.trusted`), the rule the modules follow."""

    def __init__(self, folder: Path, dag_path: Path):
        self.folder = Path(folder)
        self.dag_path = dag_path

    def write(self, store: wasmtime.Store, memory: wasmtime.Memory, entries: list[dict], cu_id: str,
              stamps: Stamps) -> None:
        if not entries:
            return
        raw = np.frombuffer(memory.get_buffer_ptr(store), dtype=np.uint8)
        for entry in entries:
            path = confined_path(self.folder, entry["path"])    # read_dag checked it stays inside
            target = memoryview(raw[entry["offset"]:entry["offset"] + entry["bytes"]])
            try:
                with open(path, "rb") as f:
                    complete = f.readinto(target) == entry["bytes"] and not f.read(1)
            except (OSError, TypeError):
                raise CortexError(f"{entry['path']}: missing (weights of {cu_id} in {self.dag_path}); "
                                  "run 'cortex compile-wasm' again") from None
            if complete and trusted(stamps, path, entry["sha256"]):
                continue
            if not complete or hashlib.sha256(target).hexdigest() != entry["sha256"]:
                raise CortexError(f"{path}: sha256 differs from {self.dag_path} (weights of {cu_id} were modified "
                                  "or are stale); run 'cortex compile-wasm' again")
            remember(stamps, path, entry["sha256"])
