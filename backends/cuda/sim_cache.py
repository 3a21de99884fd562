"""The cuda-sim build cache: host libraries and runtime objects keyed by the hash of their inputs.

Every distinct .cu ever run adds a library (about 50 KB), so the folder is bounded: after each new
build, files are deleted oldest-used first until the folder is within the limit. A cache hit marks
its file used (mtime), so what a workload keeps running stays. The limit is `CORTEX_SIM_CACHE_MB`
(default 1024 MiB; `0` turns the bound off); the folder is `$CORTEX_CACHE_DIR/cuda-sim`, by default
`~/.cache/cortex/cuda-sim`. Files used in the last minute are never deleted, so a build running in
another thread or process does not lose the runtime object it is linking or the library it is about
to load; a lone folder left by a killed build is deleted once it is an hour old.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from ir.errors import CortexError

LIMIT_VARIABLE = "CORTEX_SIM_CACHE_MB"
DEFAULT_LIMIT_MB = 1024
IN_USE_SECONDS = 60.0          # younger files are never deleted
STALE_BUILD_SECONDS = 3600.0   # a temporary build folder this old belongs to a build that died


def cache_dir() -> Path:
    root = Path(os.environ.get("CORTEX_CACHE_DIR") or Path.home() / ".cache" / "cortex")
    return root / "cuda-sim"


def limit_bytes() -> int | None:
    """The bound from CORTEX_SIM_CACHE_MB (MiB, fractions allowed), or None when it is 0 (unbounded)."""
    text = os.environ.get(LIMIT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_LIMIT_MB * 2**20
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not mb >= 0:   # also refuses nan
        raise CortexError(f"{LIMIT_VARIABLE}={text!r}: expected a size in MiB (a number >= 0; 0 means unbounded)")
    return int(mb * 2**20) if mb else None


def mark_used(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:   # deleted meanwhile by another process's prune: the caller rebuilds
        pass


def prune(folder: Path | None = None, limit: int | None = None, *, now: float | None = None) -> list[Path]:
    """Delete the oldest-used entries until `folder` holds at most `limit` bytes; returns what went.
    `limit` defaults to `limit_bytes()`."""
    folder = folder or cache_dir()
    limit = limit_bytes() if limit is None else limit
    now = time.time() if now is None else now
    removed: list[Path] = []
    entries: list[tuple[float, int, Path]] = []   # (last use, bytes, path)
    try:
        scan = list(os.scandir(folder))
    except FileNotFoundError:
        return removed
    for entry in scan:
        try:
            if entry.is_dir(follow_symlinks=False):
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_BUILD_SECONDS:
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(Path(entry.path))
                continue
            stat = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        entries.append((stat.st_mtime, stat.st_size, Path(entry.path)))
    if limit is None:
        return removed
    total = sum(size for _, size, _ in entries)
    for used, size, path in sorted(entries, key=lambda e: (e[0], e[2].name)):
        if total <= limit:
            break
        if now - used < IN_USE_SECONDS:
            break   # everything after this is newer still
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        total -= size
        removed.append(path)
    return removed
