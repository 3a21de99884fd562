"""The compile cache's options, shared by `cortex build` and every `cortex compile-<target>`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cortex.compile_cache import DEFAULT_MAX_MB, CompileCache, default_cache_dir

CACHE_PARAMETERS = ("cache_dir", "cache_max_mb", "no_cache")

CacheDir = Annotated[Optional[Path], typer.Option(
    "--cache-dir", help=f"Folder of the compile cache, shared between builds [default: {default_cache_dir()}, "
                        "under $XDG_CACHE_HOME when set].")]
CacheMaxMb = Annotated[float, typer.Option(
    "--cache-max-mb", help="Bound on the compile cache's size in MiB; the least recently used entries go first.")]
NoCache = Annotated[bool, typer.Option("--no-cache", help="Build every CU, neither reading nor filling the cache.")]


def open_cache(cache_dir: Path | None, cache_max_mb: float = DEFAULT_MAX_MB,
               no_cache: bool = False) -> CompileCache | None:
    return None if no_cache else CompileCache(cache_dir, cache_max_mb)
