"""The wasm device: run a dag.json whose CUs were compiled by `cortex compile-wasm`.

Loading checks every module's sha256 against dag.json (a tampered or stale file is refused),
configures one wasmtime Engine with the features the modules were built with, and compiles each
module once: the native code is cached next to the artifact (`cu-0003.<hash>.cwasm`) and reused by
later loads. Running copies each CU's inputs into its memory, makes one call, and hands its outputs
on as zero-copy views of that memory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

from pathlib import Path

import numpy as np
import wasmtime

from backends.wasm.assemble import make_engine
from backends.wasm.device import WasmInstance
from backends.wasm.options import WasmOptions, parse_options
from ir.errors import CortexError


class WasmDevice:
    name = "wasm"

    def __init__(self, dag: dict, dag_path: Path):
        self.dag = dag
        records = {}
        for cu in dag["cus"]:
            record = cu.get("artifacts", {}).get("wasm")
            if record is None:
                raise CortexError(f"{dag_path}: {cu['id']} has no wasm artifact; run 'cortex compile-wasm "
                                  f"--dag {dag_path}' first")
            records[cu["id"]] = record
        self.options = _common_options(records.values(), dag_path)
        self.engine = make_engine(self.options)
        self.instances: dict[str, WasmInstance] = {}
        for cu in dag["cus"]:
            record = records[cu["id"]]
            path = dag_path.parent / record["path"]
            module = _load_module(self.engine, path, record["sha256"], dag_path, cu["id"])
            self.instances[cu["id"]] = WasmInstance(self.engine, module, record["memory"])

    def run_cu(self, cu: dict, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        instance = self.instances[cu["id"]]
        try:
            return instance.run({name: env[name] for name in cu["inputs"]})
        except wasmtime.Trap as e:
            raise CortexError(f"{cu['id']} ({', '.join(cu.get('op_types', []))}) trapped: {_trap_reason(e)}") from None


def _trap_reason(trap: wasmtime.Trap) -> str:
    """wasmtime puts the backtrace first and the reason ("wasm trap: ...") last."""
    lines = [line.strip() for line in str(trap).splitlines() if line.strip()]
    reasons = [line.removeprefix("wasm trap: ") for line in lines if line.startswith("wasm trap:")]
    return reasons[-1] if reasons else (lines[-1] if lines else "unknown trap")


def _common_options(records, dag_path: Path) -> WasmOptions:
    seen = {(tuple(r["options"]["features"]), r["options"].get("target"), r["options"].get("opt_level")) for r in records}
    features = sorted({f for feats, _, _ in seen for f in feats})
    target = next(iter(seen))[1] if seen else None
    try:
        return parse_options(target, ",".join(features), "2")
    except CortexError as e:
        raise CortexError(f"{dag_path}: wasm artifacts record unusable options: {e}") from None


def _load_module(engine: wasmtime.Engine, path: Path, sha256: str, dag_path: Path, cu_id: str) -> wasmtime.Module:
    if not path.is_file():
        raise CortexError(f"{path}: missing ({cu_id} in {dag_path}); run 'cortex compile-wasm' again")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CortexError(f"{path}: sha256 differs from {dag_path} (the module was modified or is stale); "
                          "run 'cortex compile-wasm' again")
    cache = path.with_name(f"{path.stem}.{_engine_key(engine, sha256)}.cwasm")
    if _cache_intact(cache):
        try:
            return wasmtime.Module.deserialize_file(engine, str(cache))
        except wasmtime.WasmtimeError:
            pass    # compiled by another wasmtime version or configuration: compile afresh
    try:
        module = wasmtime.Module(engine, data)
    except wasmtime.WasmtimeError as e:
        raise CortexError(f"{path}: not a loadable module: {str(e).splitlines()[0]}") from None
    _write_cache(cache, module)
    return module


def _engine_key(engine: wasmtime.Engine, sha256: str) -> str:
    # The module hash plus wasmtime's own version: a cache entry never outlives either.
    version = getattr(wasmtime, "__version__", None) or _wasmtime_version()
    return hashlib.sha256(f"{sha256}:{version}".encode()).hexdigest()[:16]


def _wasmtime_version() -> str:
    from importlib.metadata import version
    return version("wasmtime")


def _cache_intact(cache: Path) -> bool:
    """Native code is trusted as it is loaded, so it must be byte for byte what we wrote: its
    sha256 sits next to it and a damaged or edited cache entry is simply recompiled."""
    digest = cache.with_name(cache.name + ".sha256")
    try:
        return hashlib.sha256(cache.read_bytes()).hexdigest() == digest.read_text().strip()
    except OSError:
        return False


def _write_cache(cache: Path, module: wasmtime.Module) -> None:
    """Best effort: a read-only artifact folder just means compiling on every load."""
    data = bytes(module.serialize())
    try:
        for target, content in ((cache, data), (cache.with_name(cache.name + ".sha256"),
                                                hashlib.sha256(data).hexdigest().encode())):
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.replace(tmp, target)
    except OSError:
        pass


