"""Warm loads: a second `cortex.load` of the same dag.json maps the native-code cache instead of
reading and hashing every artifact again, and still refuses a module or a cache entry that changed
since it was verified, even when its size and mtime were put back."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

import cortex
import backends.wasm.native_cache as wasm_runtime
from ir.fs import file_sha256
from ir.errors import CortexError
from testdata import sample_model
from wasm_cases import compile_pipeline


@pytest.fixture
def cnn(tmp_path, monkeypatch):
    # The files are compiled a moment before the loads below: without this they would all count as
    # changed too recently to be trusted by identity, and every load would hash them again.
    monkeypatch.setattr(wasm_runtime, "RACY_SECONDS", -3600.0)
    case = sample_model("cnn")
    return case, compile_pipeline(case.path, tmp_path, features="simd,relaxed-simd", opt_level="3",
                                  min_cu_size=64, max_cu_depth=3)


def _artifacts_read(monkeypatch) -> list[str]:
    read, original = [], pathlib.Path.read_bytes

    def counting(self):
        if self.suffix in (".wasm", ".cwasm"):
            read.append(self.name)
        return original(self)
    def hashing(path):
        read.append(pathlib.Path(path).name)
        return file_sha256(path)
    monkeypatch.setattr(pathlib.Path, "read_bytes", counting)
    monkeypatch.setattr(wasm_runtime, "file_sha256", hashing)
    return read


def _rewrite_keeping_size_and_mtime(path: pathlib.Path, flip_at: int) -> None:
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[flip_at] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


def test_a_warm_load_reads_no_artifact_and_runs_correctly(cnn, monkeypatch):
    case, dag_path = cnn
    cortex.load(dag_path)                                   # compiles, caches, stamps
    read = _artifacts_read(monkeypatch)
    got = cortex.load(dag_path).run(case.inputs)
    assert read == []
    np.testing.assert_allclose(got["y"], case.outputs["y"], rtol=1e-4, atol=1e-5)


def test_a_module_changed_after_a_load_is_refused_even_with_its_mtime_put_back(cnn):
    _, dag_path = cnn
    cortex.load(dag_path)
    dag = json.loads(dag_path.read_text())
    module = dag_path.parent / dag["cus"][0]["artifacts"]["wasm"]["path"]
    _rewrite_keeping_size_and_mtime(module, -1)
    with pytest.raises(CortexError, match="sha256 differs"):
        cortex.load(dag_path)


def test_a_cache_entry_changed_after_a_load_is_recompiled_not_loaded(cnn, monkeypatch):
    case, dag_path = cnn
    cortex.load(dag_path)
    caches = sorted((dag_path.parent / "wasm-bin").glob("*.cwasm"))
    for cache in caches:
        _rewrite_keeping_size_and_mtime(cache, len(cache.read_bytes()) // 2)
    read = _artifacts_read(monkeypatch)
    got = cortex.load(dag_path).run(case.inputs)
    np.testing.assert_allclose(got["y"], case.outputs["y"], rtol=1e-4, atol=1e-5)
    assert sorted(name for name in read if name.endswith(".cwasm")) == [c.name for c in caches]   # hashed, refused


def test_files_changed_just_before_their_check_are_hashed_again(cnn, monkeypatch):
    _, dag_path = cnn
    monkeypatch.setattr(wasm_runtime, "RACY_SECONDS", 3600.0)   # every file counts as just changed
    cortex.load(dag_path)
    read = _artifacts_read(monkeypatch)
    cortex.load(dag_path)
    modules = sorted((dag_path.parent / "wasm-bin").glob("*.wasm"))
    assert sorted(name for name in read if name.endswith(".wasm")) == [m.name for m in modules]
