"""Runs rendered kernels on their own: a minimal module around them under wasmtime (tests, benchmarks)."""

from __future__ import annotations

import re

import numpy as np
import wasmtime

PAGE = 65536


def engine_for(features) -> wasmtime.Engine:
    config = wasmtime.Config()
    config.wasm_simd = "simd" in features
    config.wasm_relaxed_simd = "relaxed-simd" in features
    return wasmtime.Engine(config)


def module_text(funcs: str, memory_bytes: int) -> str:
    """A module that exports its memory and every `(func $name ...)` in `funcs` under that name."""
    names = re.findall(r"^\(func \$([\w.]+)", funcs, flags=re.M)
    exports = "\n".join(f'(export "{n}" (func ${n}))' for n in names)
    pages = -(-memory_bytes // PAGE) + 1
    return f'(module (memory (export "memory") {pages})\n{funcs}\n{exports})'


def instantiate(funcs: str, memory_bytes: int, features):
    """`module_text` instantiated under wasmtime: (store, instance)."""
    engine = engine_for(features)
    store = wasmtime.Store(engine)
    instance = wasmtime.Instance(store, wasmtime.Module(engine, module_text(funcs, memory_bytes)), [])
    return store, instance


def write(store, instance, offset: int, data) -> None:
    blob = data if isinstance(data, (bytes, bytearray)) else np.ascontiguousarray(data, dtype="<f4").tobytes()
    instance.exports(store)["memory"].write(store, blob, offset)


def read(store, instance, offset: int, shape) -> np.ndarray:
    count = int(np.prod(shape))
    raw = instance.exports(store)["memory"].read(store, offset, offset + 4 * count)
    return np.frombuffer(bytes(raw), dtype="<f4").reshape(shape).copy()
