"""The result cache: a CU whose inputs are byte-identical to an earlier run's hands back that run's
outputs without running.

Keys are xxh3_128 digests. A tensor's key hashes its dtype, shape and bytes (`hash_tensor`); a
CU's key hashes its identity (id, device, the sha256 of its cu.onnx and of the artifact that
device runs) and its inputs' keys in order (`cu_key`). Each entry keeps its outputs' keys, computed
when it was stored, so the outputs of a cache hit need no hashing in a later request: a CU that
reads only hits and model inputs gets its key from keys alone (hash chaining). Keys stay content
keys either way, so a tensor hashed from its bytes and one chained from a hit agree.

Entries are read-only. They are host copies, or, where the scheduler can tell when they would
change (`borrowed`), views of the CU's own output slots: the CU's memory holds its last results
until it runs again, so storing them costs no copy; the scheduler turns such an entry into a host
copy (`materialize`) before that CU runs again. So a stored result costs a copy only when its CU
runs again while the entry is held, not on every miss. `keeps` holds what keeps that memory alive (a
wasm store), so an entry never outlives the memory it views. Neither a caller nor a device writing
into its inputs can change what the cache holds. The cache is least-recently-used, bounded by the bytes of the
outputs it holds; an entry larger than the whole budget is never stored.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

from backends.registry import device as device_spec
from ir.ops import RANDOM, kind_of

# Room for the repeating part of a typical request (an encoder's output, a prompt's prefix) on a
# laptop or a browser tab; `cortex.load(..., cache_bytes=)` / `cortex run --cache-bytes` change it.
DEFAULT_CACHE_BYTES = 256 << 20


def hash_tensor(array: np.ndarray) -> bytes:
    """The content key of a host array: dtype, shape and bytes (a contiguous array is read
    through its buffer, with no view made)."""
    array = np.ascontiguousarray(array)
    h = xxhash.xxh3_128(_header(array.dtype.str, array.shape))
    h.update(array)
    return h.digest()


@lru_cache(maxsize=4096)
def _header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """What a key hashes before a tensor's bytes: a request meets the same few dtypes and shapes."""
    return f"{dtype}{shape}".encode()


def cu_key(identity: bytes, input_keys: list[bytes]) -> bytes:
    h = xxhash.xxh3_128(identity)
    for key in input_keys:
        h.update(key)
    return h.digest()


@dataclass(frozen=True)
class CacheEntry:
    outputs: dict[str, np.ndarray]      # read-only host copies, or views of a CU's output slots
    output_keys: dict[str, bytes]
    nbytes: int
    keeps: object | None = None         # what keeps the memory the views lie in alive; None: host copies


def read_only(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    array.setflags(write=False)
    return array


class ResultCache:
    def __init__(self, budget_bytes: int = DEFAULT_CACHE_BYTES):
        if budget_bytes < 0:
            raise ValueError("the cache budget cannot be negative")
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget_bytes

    @staticmethod
    def tensor_key(array: np.ndarray) -> bytes:
        return hash_tensor(array)

    def get(self, key: bytes) -> CacheEntry | None:
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes, outputs: dict[str, np.ndarray], keeps: object | None = None) -> CacheEntry | None:
        """Store `outputs`, host arrays the cache takes over (a device's `to_host` copies) or, with
        `keeps`, views of a CU's output slots that the caller will `materialize` before they change;
        made read-only, with their keys; None when they exceed the whole budget. Least recently used
        entries go first to make room."""
        copies, keys, nbytes = {}, {}, 0
        for name, array in outputs.items():
            copies[name] = array = read_only(array if keeps is None else array.view())
            nbytes += array.nbytes
        if not self.fits(nbytes):
            return None
        for name, array in copies.items():
            keys[name] = hash_tensor(array)
        entry = CacheEntry(copies, keys, nbytes, keeps)
        old = self.entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        while self.entries and self.nbytes + nbytes > self.budget_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.evictions += 1
        self.entries[key] = entry
        self.nbytes += nbytes
        return entry

    def materialize(self, key: bytes) -> None:
        """The entry under `key`, if still held and a view, as host copies (its place in the LRU kept)."""
        entry = self.entries.get(key)
        if entry is not None and entry.keeps is not None:
            self.entries[key] = CacheEntry({name: read_only(np.array(a)) for name, a in entry.outputs.items()},
                                           entry.output_keys, entry.nbytes)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "budget_bytes": self.budget_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


def holds_random_ops(cu: dict) -> bool:
    """build-dag marks such CUs (`random: true`); the registry answers for older dag.json files."""
    return bool(cu.get("random")) or any(kind_of(op) == RANDOM for op in cu.get("op_types", []))


def cu_identity(cu: dict, where: str) -> bytes:
    """What a CU's cached results depend on besides its inputs: the CU, the device that runs it
    and the exact code it runs there (its cu.onnx and that device's artifact record, hashes
    included). A reduced-precision variant computes other bits, so it needs an identity of its own."""
    artifact = device_spec(where).artifact
    record = cu.get("artifacts", {}).get(artifact) if artifact else None
    return json.dumps([cu["id"], where, cu["sha256"], record], sort_keys=True).encode()
