"""Weights outside the module: content-addressed files the device writes into a CU's memory.

With `--external-weights` (always on for shape specializations) a module carries no data segments.
Each weight storage becomes `weights/<sha256>.bin`, named by its bytes, and the record lists where
it goes (`artifacts.wasm.weights`: file, memory offset, bytes, sha256). Builds that hold the same
weights (the same CU compiled for several input shapes, a weight repeated in one model) therefore
store it once, and a module whose code is identical across shapes is one `modules/<sha256>.wasm`.
At load each file is read, its sha256 checked against the record, and copied to its offset: one
copy per load, where embedded active segments are mapped copy-on-write from the native-code cache
(docs/runtime.md measures both).
"""

from __future__ import annotations

import os
from pathlib import Path

import wasmtime

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
    """Writes a record's weight files into an instance's memory. A file several CUs share is read
    and hashed once per loader (keyed by its identity, so a file replaced meanwhile is read again)."""

    def __init__(self, folder: Path, dag_path: Path):
        self.folder = Path(folder)
        self.dag_path = dag_path
        self._verified: dict[tuple, bytes] = {}

    def write(self, store: wasmtime.Store, memory: wasmtime.Memory, entries: list[dict], cu_id: str) -> None:
        for entry in entries:
            memory.write(store, self._read(entry, cu_id), entry["offset"])

    def _read(self, entry: dict, cu_id: str) -> bytes:
        path = confined_path(self.folder, entry["path"])    # read_dag checked it stays inside
        try:
            st = os.stat(path)
            key = (str(path), st.st_size, st.st_ino, st.st_mtime_ns, entry["sha256"])
            if key in self._verified:
                return self._verified[key]
            data = Path(path).read_bytes()
        except (OSError, TypeError):
            raise CortexError(f"{entry['path']}: missing (weights of {cu_id} in {self.dag_path}); "
                              "run 'cortex compile-wasm' again") from None
        if len(data) != entry["bytes"] or sha256_bytes(data) != entry["sha256"]:
            raise CortexError(f"{path}: sha256 differs from {self.dag_path} (weights of {cu_id} were modified "
                              "or are stale); run 'cortex compile-wasm' again")
        self._verified[key] = data
        return data
