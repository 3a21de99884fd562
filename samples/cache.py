"""Where the generated test data lives, and how it is built without races.

Everything generated lands under `.cache/` at the repository root (git-ignored). A data set is built
in a temporary sibling folder or file and renamed into place, under a file lock, so parallel test
workers (pytest -n 2) never see a half-written set and never build the same one twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Iterator

@dataclass
class SampleModel:
    """A generated or shipped test model with an input feed and its reference outputs; the input
    shapes and dims bind its dynamic axes (`--input-shape`, `--dim`)."""
    name: str
    path: Path
    inputs: dict
    outputs: dict
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)


REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("CORTEX_CACHE_DIR", REPO_ROOT / ".cache"))


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_folder(target: Path, build: Callable[[Path], None], force: bool = False) -> Path:
    """Build `target` once with `build(tmp_folder)`, then swap it in atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.name):
        if target.is_dir() and not force:
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is ordinary shared data
            if target.exists():
                old = target.with_name(f".{target.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(target, old)
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def ensure_file(target: Path, build: Callable[[Path], None], force: bool = False) -> Path:
    """Build `target` once with `build(tmp_path)` (a path in the same folder), then rename it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.name):
        if target.is_file() and not force:
            return target
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            build(Path(tmp))
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is ordinary shared data
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return target
