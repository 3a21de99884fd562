"""The native code of each module, cached next to it and trusted without re-hashing while unchanged.

`load_module` compiles a .wasm once: the native code is cached next to the artifact
(`cu-0003.<hash>.cwasm`, its verified stamp in the folder's `cwasm.verified.json`) and reused by
later loads, which mmap it; weights sit in active data segments, so instantiating maps them
copy-on-write from that file instead of copying them.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import wasmtime

from ir.errors import CortexError
from ir.fs import file_sha256, sha256_bytes, write_bytes_atomically


@dataclass
class CacheWrites:
    """Whether a load may still write native code to the cache. A load abandoned at its timeout
    (backends/wasm/sandbox.py: load_within) sets `abandoned` under `lock`, which a write holds, so
    once `abandon` returns nothing is being written and nothing more will be."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True


def load_module(engine: wasmtime.Engine, path: Path, sha256: str, dag_path: Path, cu_id: str,
                stamps: Stamps, engine_tag: str = "", writes: CacheWrites | None = None) -> wasmtime.Module:
    """The module compiled to native code, from the cache when it holds this exact module.

    A warm load reads neither file: the cache's stamp (see `Stamps`) records, for the .wasm and the
    .cwasm, the sha256 verified at an earlier load together with the file's size, inode, mtime and
    ctime. While those still match, the content is the one that was hashed (rewriting a file moves
    its ctime, which no user can set back), so hundreds of MB of weights are not hashed again and
    the cache is mmapped by `deserialize_file` rather than read. `engine_tag` names the engine's
    configuration where it changes the native code (epoch checks), so two configurations keep
    separate cache entries instead of recompiling over each other."""
    try:
        wasm_stat = path.stat()
        if not stat.S_ISREG(wasm_stat.st_mode):
            raise OSError
    except OSError:
        raise CortexError(f"{path}: missing ({cu_id} in {dag_path}); run 'cortex compile-wasm' again") from None
    cache = path.with_name(f"{path.stem}.{_engine_key(sha256 + engine_tag)}.cwasm")
    stamp = stamps.get(cache)
    wasm_entry, data = stamp.get("wasm"), None
    if not (_unchanged(wasm_entry, wasm_stat) and wasm_entry["sha256"] == sha256):
        data = path.read_bytes()
        if sha256_bytes(data) != sha256:
            raise CortexError(f"{path}: sha256 differs from {dag_path} (the module was modified or is stale); "
                              "run 'cortex compile-wasm' again")
        wasm_entry = _entry(sha256, path)
    cache_entry = _verified_cache(cache, stamp.get("cwasm"))
    if cache_entry is not None:
        try:
            module = wasmtime.Module.deserialize_file(engine, str(cache))
            if wasm_entry:
                stamps.set(cache, {"wasm": wasm_entry, "cwasm": cache_entry})
            return module
        except wasmtime.WasmtimeError:
            pass    # compiled by another wasmtime version or configuration: compile afresh
    try:
        module = wasmtime.Module(engine, data if data is not None else path.read_bytes())
    except wasmtime.WasmtimeError as e:
        raise CortexError(f"{path}: not a loadable module: {str(e).splitlines()[0]}") from None
    native = bytes(module.serialize())
    writes = writes or CacheWrites()
    with writes.lock:
        if not writes.abandoned and _write_file(cache, native):
            cache_entry = _entry(sha256_bytes(native), cache, written=True)
            if wasm_entry and cache_entry:
                stamps.set(cache, {"wasm": wasm_entry, "cwasm": cache_entry})
    return module


def _engine_key(sha256: str) -> str:
    # The module hash plus wasmtime's own version: a cache entry never outlives either ("relaxed-native":
    # the engine lowers relaxed SIMD as the host does, assemble.make_engine).
    return sha256_bytes(f"{sha256}:{_wasmtime_version()}:relaxed-native".encode())[:16]


@functools.cache
def _wasmtime_version() -> str:
    return getattr(wasmtime, "__version__", None) or version("wasmtime")


# A file changed within this many seconds after it was hashed could change again without moving
# its timestamps (they tick in jiffies, not nanoseconds): such a file is hashed again at the next load.
RACY_SECONDS = 0.1


class Stamps:
    """The stamps of one load: one JSON file per artifact folder (`STAMP_FILE`, cache file name ->
    stamp), read once and written back once at the end if anything changed, so a warm load of a
    model with hundreds of CUs opens one small file instead of one per CU. Concurrent loads may
    overwrite each other's entries; a lost entry only means hashing that file again next time."""

    def __init__(self):
        self._folders: dict[str, dict] = {}     # folder (as text: hashing Paths is slow) -> stamps
        self._changed: set[str] = set()

    def _folder(self, folder: str) -> dict:
        if folder not in self._folders:
            try:
                stamps = json.loads(Path(folder, STAMP_FILE).read_text())
            except (OSError, ValueError):
                stamps = {}
            self._folders[folder] = stamps if isinstance(stamps, dict) else {}
        return self._folders[folder]

    def get(self, cache: Path) -> dict:
        stamp = self._folder(os.path.dirname(cache)).get(cache.name)
        return stamp if isinstance(stamp, dict) else {}

    def set(self, cache: Path, stamp: dict) -> None:
        folder = os.path.dirname(cache)
        stamps = self._folder(folder)
        if stamps.get(cache.name) != stamp:
            stamps[cache.name] = stamp
            self._changed.add(folder)

    def save(self) -> None:
        for folder in sorted(self._changed):
            _write_file(Path(folder, STAMP_FILE), json.dumps(self._folders[folder], sort_keys=True).encode())
        self._changed.clear()


STAMP_FILE = "cwasm.verified.json"


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _entry(sha256: str, path: Path, written: bool = False) -> dict | None:
    """What a later load needs to trust `path` without hashing it: its verified sha256, its
    identity, and when it was hashed (or that we wrote it ourselves, from bytes we had hashed)."""
    try:
        return {"sha256": sha256, "stat": _identity(path.stat()), "checked_ns": time.time_ns(), "written": written}
    except OSError:
        return None


def _unchanged(entry, st: os.stat_result) -> bool:
    """The file is the one whose sha256 `entry` records, judged by its identity alone."""
    if not isinstance(entry, dict) or entry.get("stat") != _identity(st) or not isinstance(entry.get("checked_ns"), int):
        return False
    return entry.get("written") is True or max(st.st_mtime_ns, st.st_ctime_ns) < entry["checked_ns"] - RACY_SECONDS * 1e9


def _verified_cache(cache: Path, entry) -> dict | None:
    """Native code is trusted as it is loaded, so it must be byte for byte what we wrote: the
    stamp's sha256 vouches for it (by identity while unchanged, else hashed again); a damaged or
    edited entry is simply recompiled."""
    if not isinstance(entry, dict):
        return None
    try:
        if _unchanged(entry, cache.stat()):
            return entry
        if file_sha256(cache) == entry.get("sha256"):
            return _entry(entry["sha256"], cache)
    except OSError:
        pass
    return None


def _write_file(target: Path, content: bytes) -> bool:
    """Best effort: a read-only artifact folder just means compiling on every load."""
    try:
        write_bytes_atomically(target, content)   # also removes its temporary file when a write fails
        return True
    except OSError:
        return False


def trusted(stamps: Stamps, path: Path, sha256: str) -> bool:
    """Whether `path` is the file whose sha256 an earlier load verified (by its identity, as the
    modules are): a warm load then need not hash it again."""
    try:
        entry = stamps.get(path).get("file")
        return _unchanged(entry, path.stat()) and entry["sha256"] == sha256
    except OSError:
        return False


def remember(stamps: Stamps, path: Path, sha256: str) -> None:
    """Record that `path` was just hashed to `sha256` (saved with the load's other stamps)."""
    entry = _entry(sha256, path)
    if entry is not None:
        stamps.set(path, {"file": entry})
