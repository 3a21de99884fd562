"""The cuda-sim build cache stays within CORTEX_SIM_CACHE_MB, deleting the oldest-used files first,
and never what a build is using right now."""

from __future__ import annotations

import os
import textwrap
import time

import numpy as np
import pytest

from backends.cuda import sim_cache
from backends.cuda.sim import SimModule
from ir.errors import CortexError

KB = 1024


def _file(folder, name: str, size: int, age_s: float):
    path = folder / name
    path.write_bytes(b"\0" * size)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_the_oldest_used_files_go_first_until_the_folder_fits(tmp_path):
    oldest = _file(tmp_path, "a.so", 40 * KB, age_s=3000)
    older = _file(tmp_path, "b.so", 40 * KB, age_s=2000)
    recent = _file(tmp_path, "c.so", 40 * KB, age_s=1000)
    removed = sim_cache.prune(tmp_path, limit=90 * KB)
    assert removed == [oldest]
    assert not oldest.exists() and older.exists() and recent.exists()
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 90 * KB


def test_files_in_use_in_the_last_minute_are_kept_even_over_the_limit(tmp_path):
    old = _file(tmp_path, "old.so", 40 * KB, age_s=600)
    fresh = [_file(tmp_path, f"fresh{i}.so", 40 * KB, age_s=1) for i in range(3)]
    sim_cache.prune(tmp_path, limit=10 * KB)
    assert not old.exists() and all(p.exists() for p in fresh)


def test_a_folder_left_by_a_killed_build_is_deleted_once_stale(tmp_path):
    stale, live = tmp_path / "tmpdead", tmp_path / "tmplive"
    for folder, age in ((stale, 2 * sim_cache.STALE_BUILD_SECONDS), (live, 5)):
        folder.mkdir()
        (folder / "cu.cu").write_text("x")
        stamp = time.time() - age
        os.utime(folder, (stamp, stamp))
    sim_cache.prune(tmp_path, limit=None)
    assert not stale.exists() and live.exists()


@pytest.mark.parametrize("value, expected", [("", sim_cache.DEFAULT_LIMIT_MB * 2**20), ("0.5", 2**19), ("0", None)])
def test_the_limit_comes_from_the_environment_with_a_documented_default(monkeypatch, value, expected):
    monkeypatch.setenv(sim_cache.LIMIT_VARIABLE, value)
    assert sim_cache.limit_bytes() == expected


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_a_bad_limit_is_one_clear_line(monkeypatch, value):
    monkeypatch.setenv(sim_cache.LIMIT_VARIABLE, value)
    with pytest.raises(CortexError, match=f"^{sim_cache.LIMIT_VARIABLE}=.*MiB"):
        sim_cache.limit_bytes()


def test_a_new_build_bounds_the_cache_and_the_new_module_runs(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("CORTEX_CACHE_DIR", str(cache))
    (cache / "cuda-sim").mkdir(parents=True)
    leftovers = [_file(cache / "cuda-sim", f"cu-old{i}-0123456789.so", 200 * KB, age_s=3600 + i) for i in range(10)]
    # Room for the new library, the runtime object and a few of the leftovers (the newest ones).
    monkeypatch.setenv(sim_cache.LIMIT_VARIABLE, "1")
    source = tmp_path / "twice.cu"
    source.write_text(textwrap.dedent("""
        extern "C" __global__ void twice(float* x, int n) {
            int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) x[i] *= 2.f;
        }
    """))
    module = SimModule(source)
    x = np.arange(5, dtype=np.float32)
    module.kernel("twice").launch(1, 32, 0, [x, 5])
    np.testing.assert_array_equal(x, 2 * np.arange(5, dtype=np.float32))
    kept = [p for p in leftovers if p.exists()]
    assert module.library_path.exists() and len(kept) < len(leftovers)
    assert kept == leftovers[:len(kept)]    # the most recently used leftovers (smallest age) survive
    assert sum(p.stat().st_size for p in (cache / "cuda-sim").iterdir() if p.is_file()) <= 2**20
