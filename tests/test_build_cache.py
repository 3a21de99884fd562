"""The compile cache: entries keyed by everything an artifact depends on, verified before use,
bounded by least-recent use; compile-<target> reads and fills it, and its outputs are a clean
build's, byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import run_cli
from testdata import SAMPLES_DIR

from backends.registry import BuiltCU, target
from cortex import compile_cache
from cortex.compile_cache import NO_VARIANT, CompileCache
from ir.options import from_text

WASM = target("wasm")
BUILT = BuiltCU({"cu-0000.wasm": b"\0asm-module", "cu-0000.wat": b"(module)"},
                {"file": "cu-0000.wasm", "bytes": 11, "memory": {"pages": 2, "buffers": [[0, 64]]}})


def key(cache: CompileCache, **changes) -> str:
    args = {"options": from_text(WASM.options), "cu_id": "cu-0000", "cu_sha256": "ab" * 32, "precision": None}
    args.update(changes)
    return cache.key(WASM, args["options"], args["cu_id"], args["cu_sha256"], args["precision"])


def test_an_entry_comes_back_as_it_was_stored(tmp_path):
    cache = CompileCache(tmp_path)
    cache.put("a" * 64, BUILT)
    cache.put("b" * 64, None)
    assert cache.get("a" * 64) == BUILT
    assert cache.get("b" * 64) is NO_VARIANT
    assert cache.get("c" * 64) is None
    assert (cache.hits, cache.misses) == (2, 1)


def test_the_key_changes_with_everything_the_artifact_depends_on(tmp_path, monkeypatch):
    cache = CompileCache(tmp_path)
    base = key(cache)
    assert key(cache) == base
    others = [key(cache, options=from_text(WASM.options, opt_level="3")),
              key(cache, options=from_text(WASM.options, emit_wat=True)),
              key(cache, cu_id="cu-0001"), key(cache, cu_sha256="cd" * 32), key(cache, precision="fp16")]
    monkeypatch.setattr(compile_cache, "compiler_version", lambda: "0.1.0+edited-source")
    others.append(key(cache))
    assert len({base, *others}) == len(others) + 1


def test_the_compiler_version_hashes_the_compiler_sources():
    version = compile_cache.compiler_version()
    assert version.split("+")[0] and len(version.split("+")[1]) == 16
    assert all((compile_cache.ROOT / name).exists() for name in compile_cache.COMPILER_SOURCES)


def test_a_corrupted_entry_is_a_miss_not_a_result(tmp_path):
    cache = CompileCache(tmp_path)
    for flip_at in (70, -3):                 # in the header (the record), in a file's bytes
        cache.put("a" * 64, BUILT)
        path = tmp_path / f"{'a' * 64}.entry"
        data = bytearray(path.read_bytes())
        data[flip_at] ^= 1
        path.write_bytes(bytes(data))
        assert cache.get("a" * 64) is None
    path.write_bytes(b"")
    assert cache.get("a" * 64) is None
    assert cache.corrupt == 3


def test_pruning_deletes_the_least_recently_used_entries_first(tmp_path):
    cache = CompileCache(tmp_path, max_mb=2.5 * 2**10 / 2**20)   # room for two 1 KiB entries
    big = BuiltCU({"f": bytes(1000)}, {})
    for i, name in enumerate("abc"):
        cache.put(name * 64, big)
        os.utime(tmp_path / f"{name * 64}.entry", (1000 + i, 1000 + i))
    assert cache.get("a" * 64) is not None        # a hit: "a" is now the most recently used
    assert cache.prune() == 1
    assert sorted(p.name[0] for p in tmp_path.glob("*.entry")) == ["a", "c"]


def test_a_cache_that_cannot_exist_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(Exception, match="--cache-dir .*file exists and is not a folder"):
        CompileCache(tmp_path / "file")


def cu_folder(tmp_path: Path) -> None:
    for argv in (["decompose", "--model-path", SAMPLES_DIR / "cnn.onnx", "--output-dir", "cus", "--max-cu-size", "3000"],
                 ["build-dag", "--cu-dir", "cus", "--output", "dag.json"]):
        code, _, err = run_cli(argv, cwd=tmp_path)
        assert code == 0, err


def compile_wasm(tmp_path: Path, *options: str, env: dict | None = None) -> dict:
    code, stdout, err = run_cli(["compile-wasm", "--cu-dir", "cus", "--output", "wasm-bin", "--dag", "dag.json",
                                 "--json", *options], cwd=tmp_path, env=env)
    assert code == 0, err
    return json.loads(stdout)


def artifacts(tmp_path: Path) -> dict[str, bytes]:
    files = [tmp_path / "dag.json", *sorted((tmp_path / "wasm-bin").iterdir())]
    return {p.name: p.read_bytes() for p in files}


def test_compile_wasm_reuses_cached_cus_and_rebuilds_a_corrupted_one(tmp_path):
    cu_folder(tmp_path)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}      # the default folder: $XDG_CACHE_HOME/cortex/compile
    first = compile_wasm(tmp_path, env=env)
    clean = artifacts(tmp_path)
    entries = sorted((tmp_path / "xdg" / "cortex" / "compile").glob("*.entry"))
    assert first["compiled_cus"] == first["cus"] == len(entries) > 1

    second = compile_wasm(tmp_path, env=env)
    assert (second["compiled_cus"], second["reused_cus"]) == (0, first["cus"])
    assert artifacts(tmp_path) == clean

    data = bytearray(entries[0].read_bytes())
    data[-1] ^= 0xFF
    entries[0].write_bytes(bytes(data))
    third = compile_wasm(tmp_path, env=env)
    assert (third["compiled_cus"], third["reused_cus"]) == (1, first["cus"] - 1)
    assert artifacts(tmp_path) == clean


@pytest.mark.slow
def test_no_cache_reads_and_writes_no_cache_and_the_bound_holds(tmp_path):
    cu_folder(tmp_path)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    summary = compile_wasm(tmp_path, "--no-cache", env=env)
    assert summary["compiled_cus"] == summary["cus"]
    assert not (tmp_path / "xdg" / "cortex" / "compile").exists()
    clean = artifacts(tmp_path)
    compile_wasm(tmp_path, "--cache-dir", "small", "--cache-max-mb", "0.05")
    assert sum(p.stat().st_size for p in (tmp_path / "small").iterdir()) <= 0.05 * 2**20
    assert artifacts(tmp_path) == clean


@pytest.mark.slow
def test_variants_come_from_the_cache_too(tmp_path):
    cu_folder(tmp_path)
    first = compile_wasm(tmp_path, "--variants", "fp16", "--cache-dir", "cache")
    built = artifacts(tmp_path)
    assert any(name.endswith("-fp16.wasm") for name in built)
    second = compile_wasm(tmp_path, "--variants", "fp16", "--cache-dir", "cache")
    assert (second["compiled_cus"], second["reused_cus"]) == (0, first["cus"])
    assert artifacts(tmp_path) == built
