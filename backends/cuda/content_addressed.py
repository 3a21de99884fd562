"""CUDA artifacts named by their content, so that builds which make the same file store it once.

With `--external-weights` (always on for shape specializations) every file of a CU is named by its
sha256: the source `modules/<sha256>.cu`, its PTX `modules/<sha256>.ptx`, each cubin
`modules/<sha256>.sm_XX.cubin`, and the weights blob is split into one `weights/<sha256>.bin` per
weight tensor, which the record lists with its offset in the blob (`artifacts.cuda.weights.segments`).
The same CU compiled for several input shapes usually differs in its code (the extents are baked
into the kernels) but not in its weights; a seq-dependent constant (a folded position slice) then
costs its own file, not a second copy of the whole blob. At load the device reads each segment into
the blob at its offset, each file checked against its sha256, and uploads the blob once, as it
uploads a single weights file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ir.errors import CortexError
from ir.fs import read_artifact, sha256_bytes

MODULES_FOLDER = "modules"
WEIGHTS_FOLDER = "weights"


def module_name(data: bytes, suffix: str) -> str:
    return f"{MODULES_FOLDER}/{sha256_bytes(data)}{suffix}"


def weight_segment_files(blob: bytes, segments: list[tuple[int, int]]) -> tuple[dict[str, bytes], dict]:
    """The files (name -> bytes) of a weights blob's segments, and the record's `weights` entry:
    the blob's size and sha256, and where each segment goes."""
    files, entries = {}, []
    for offset, size in segments:
        data = blob[offset:offset + size]
        digest = sha256_bytes(data)
        name = f"{WEIGHTS_FOLDER}/{digest}.bin"
        files[name] = data
        entries.append({"file": name, "offset": offset, "bytes": size, "sha256": digest})
    return files, {"bytes": len(blob), "sha256": sha256_bytes(blob), "segments": entries}


def file_entries(record: dict) -> list[dict]:
    """Every file the record names ({file, sha256, bytes}): source, PTX, cubins and weights (the
    blob, or its segments)."""
    weights = record["weights"]
    entries = [record["source"], record["ptx"], *record["cubins"].values(),
               *weights.get("segments", [weights])]
    return [e for e in entries if e]


def read_weights(record: dict, folder: Path, owner: str) -> np.ndarray:
    """The weights blob the kernels read, each file checked against its sha256 (at least one byte,
    so that a CU without weights still passes a valid pointer)."""
    weights = record["weights"]
    if not weights["bytes"]:
        return np.zeros(1, np.uint8)
    rebuild = "run 'cortex compile-cuda' again"
    if "segments" not in weights:
        return np.frombuffer(read_artifact(folder / weights["file"], weights["sha256"], owner, rebuild),
                             np.uint8).copy()
    blob = np.zeros(weights["bytes"], np.uint8)
    for segment in weights["segments"]:
        data = read_artifact(folder / segment["file"], segment["sha256"], owner, rebuild)
        end = segment["offset"] + segment["bytes"]
        if len(data) != segment["bytes"] or end > len(blob):
            raise CortexError(f"{folder / segment['file']}: does not fit the weights of {owner} "
                              f"({len(data)} bytes at offset {segment['offset']} of {len(blob)}); {rebuild}")
        blob[segment["offset"]:end] = np.frombuffer(data, np.uint8)
    return blob
