"""The compile cache: one CU's built artifact (its files and its dag.json record), content-addressed.

An entry's key hashes everything the artifact depends on: the sha256 of the CU's cu.onnx, the CU's
id (it names files and kernels), the precision of a variant, the target, its options, its external
toolchain (nvcc's version), the versions of onnx and numpy, and the compiler's version, which is
the package version plus a hash of the compiler's own source files (`compiler_version`), so that
editing the code invalidates what it built. The outputs of a cached build are byte-identical to a clean build's.

An entry is one file, `<key>.entry`: a first line with the sha256 of the rest, a JSON header line
(the record and each file's name and size), then the files' bytes. It is verified before use; one
that fails (a truncated write, a flipped bit, another version's format) counts as a miss and is
rebuilt. Writes are atomic, so processes can share the folder. The folder is bounded: after new
entries are stored, the least recently used are deleted until it fits; a hit marks its entry used
(mtime, since many file systems do not update access times).

This is not the wasmtime native-code cache (`backends/wasm/native_cache.py`, next to the artifacts)
nor the cuda-sim host-build cache (`backends/cuda/sim_cache.py`): those cache what running an
artifact needs; this one caches building it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from functools import cache
from importlib import metadata
from pathlib import Path

from backends.registry import BuiltCU, Target
from ir.errors import CortexError
from ir.fs import sha256_bytes, write_bytes_atomically

ENTRY_FORMAT = "cortex.compile-cache/1"
SUFFIX = ".entry"
DEFAULT_MAX_MB = 2048
ROOT = Path(__file__).resolve().parent.parent
# What a CU's artifact is computed by: loading and optimising its cu.onnx, lowering and rendering.
COMPILER_SOURCES = ("ir", "passes", "codegen", "backends", "cortex/pipeline.py", "cortex/summary.py",
                    "cortex/compile.py", "cortex/compile_cache.py", "cortex/dag.py")
# Libraries whose behaviour reaches the artifacts (loading the cu.onnx, folding constants).
LIBRARIES = ("onnx", "numpy")
NO_VARIANT = object()   # a cached "this CU has no variant in that precision" (it holds no weights)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cortex" / "compile"


@cache
def compiler_version() -> str:
    """`<package version>+<sha256 of the compiler's source files>`, first 16 hex digits."""
    try:
        version = metadata.version("cortex-compiler")
    except metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256()
    for name in COMPILER_SOURCES:
        path = ROOT / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts or file.suffix in (".pyc", ".pyo"):
                continue
            h.update(file.relative_to(ROOT).as_posix().encode() + b"\0")
            h.update(sha256_bytes(file.read_bytes()).encode())
    return f"{version}+{h.hexdigest()[:16]}"


@cache
def library_versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "none"
    return found


def options_json(options) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(options).items()}


class CompileCache:
    def __init__(self, folder: Path | None = None, max_mb: float = DEFAULT_MAX_MB):
        if not max_mb > 0:
            raise CortexError(f"--cache-max-mb {max_mb}: expected a size in MiB greater than 0 "
                              "(use --no-cache to build without the cache)")
        self.folder = Path(folder) if folder is not None else default_cache_dir()
        if self.folder.exists() and not self.folder.is_dir():
            raise CortexError(f"--cache-dir {self.folder} exists and is not a folder")
        self.max_bytes = int(max_mb * 2**20)
        self.hits = self.misses = self.corrupt = 0
        self._lock = threading.Lock()

    def key(self, target: Target, options, cu_id: str, cu_sha256: str, precision: str | None) -> str:
        parts = {"format": ENTRY_FORMAT, "cu_onnx": cu_sha256, "cu": cu_id, "precision": precision,
                 "target": target.name, "options": options_json(options),
                 "toolchain": target.toolchain(options), "compiler": compiler_version(),
                 "libraries": library_versions()}
        return sha256_bytes(json.dumps(parts, sort_keys=True).encode())

    def get(self, key: str):
        """The cached BuiltCU, NO_VARIANT, or None (a miss, or an entry that failed verification)."""
        path = self.folder / f"{key}{SUFFIX}"
        try:
            data = path.read_bytes()
        except OSError:
            return self._count(None)
        built = _decode(data)
        if built is None:
            with self._lock:
                self.corrupt += 1
            return self._count(None)
        try:
            os.utime(path)
        except OSError:   # evicted meanwhile by another build: the bytes read are still whole
            pass
        return self._count(built)

    def put(self, key: str, built: BuiltCU | None) -> None:
        """Store a build (None: no variant for that precision)."""
        try:
            write_bytes_atomically(self.folder / f"{key}{SUFFIX}", _encode(built))
        except OSError as e:
            raise CortexError(f"--cache-dir {self.folder}: cannot write a cache entry ({e.strerror or e}); "
                              "give another folder or --no-cache") from None

    def prune(self) -> int:
        """Delete least-recently-used entries until the folder fits; returns how many went."""
        entries = []
        try:
            scan = list(os.scandir(self.folder))
        except FileNotFoundError:
            return 0
        for entry in scan:
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entries.append((stat.st_mtime, entry.name, stat.st_size))
        total, removed = sum(e[2] for e in entries), 0
        for _, name, size in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                (self.folder / name).unlink()
                removed += 1
            except FileNotFoundError:
                pass
            total -= size
        return removed

    def _count(self, result):
        with self._lock:
            if result is None:
                self.misses += 1
            else:
                self.hits += 1
        return result


def _encode(built: BuiltCU | None) -> bytes:
    files = [] if built is None else list(built.files.items())
    header = {"format": ENTRY_FORMAT, "record": None if built is None else built.record,
              "files": [[name, len(data)] for name, data in files]}
    body = json.dumps(header, separators=(",", ":")).encode() + b"\n" + b"".join(d for _, d in files)
    return sha256_bytes(body).encode() + b"\n" + body


def _decode(data: bytes):
    digest, _, body = data.partition(b"\n")
    if sha256_bytes(body).encode() != digest:
        return None
    line, _, blobs = body.partition(b"\n")
    try:
        header = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(header, dict) or header.get("format") != ENTRY_FORMAT:
        return None
    if header["record"] is None:
        return NO_VARIANT
    files, offset = {}, 0
    for name, size in header["files"]:
        files[name] = blobs[offset:offset + size]
        offset += size
    return BuiltCU(files, header["record"]) if offset == len(blobs) else None
