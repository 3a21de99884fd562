"""Filesystem helpers every layer uses: atomic writes of files and folders, content hashes, and
paths confined to a folder.

A command either leaves its output complete or as it was: files and folders are built under a
temporary name beside the target and renamed into place. They get the permissions a plain `open`
would give (0666 or 0777 less the user's umask), not `mkstemp`'s 0600, so a web server or another
CI user can read what Cortex wrote.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable, TypeVar

from ir.errors import CortexError

T = TypeVar("T")
_umask_lock = threading.Lock()


def current_umask() -> int:
    # os.umask can only be read by setting it; the lock keeps threads of this process from
    # creating files under the temporary value.
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_directory_atomically(out_dir: Path, fill: Callable[[Path], T]) -> T:
    """Fill a temporary sibling folder with `fill(folder)`, then swap it in for `out_dir`; on any
    failure (an exception, Ctrl-C) `out_dir` is left as it was."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CortexError(f"output folder {out_dir} exists and is not a folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    old = None
    try:
        os.chmod(tmp, 0o777 & ~current_umask())
        result = fill(tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old / "previous")
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists() and (old / "previous").exists():
            os.replace(old / "previous", out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return result


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_artifact(path: Path, sha256: str, owner: str, rebuild: str) -> bytes:
    """The bytes of an artifact that `owner` (a dag.json, naming the CU) records with `sha256`;
    a missing, modified or stale file is one line that says how to `rebuild` it."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        raise CortexError(f"{path}: missing ({owner}); {rebuild}") from None
    if sha256_bytes(data) != sha256:
        raise CortexError(f"{path}: sha256 differs from {owner} (modified or stale); {rebuild}")
    return data


def confined_path(root: Path, relative: str) -> Path | None:
    """`root / relative` when it stays inside `root` after following symlinks; None for an
    absolute path, a `..` component, or a link that leaves the folder. For paths that come from a
    file (dag.json) which may have been fetched from an artifact store."""
    if not isinstance(relative, str) or not relative or "\0" in relative:
        return None
    candidate = Path(relative)
    if candidate.is_absolute() or ".." in candidate.parts:
        return None
    root = Path(root).resolve()
    resolved = (root / candidate).resolve()
    return resolved if resolved.is_relative_to(root) else None
