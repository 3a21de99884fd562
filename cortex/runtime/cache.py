"""The result cache: a CU whose inputs are byte-identical to an earlier run's hands back that run's
outputs without running.

Keys are xxh3_128 digests. A tensor's key hashes its dtype, shape and bytes (`hash_tensor`); a
CU's key hashes its identity (id, device, the sha256 of its cu.onnx and of the artifact that
device runs) and its inputs' keys in order (`cu_key`). Each entry keeps its outputs' keys, computed
when it was stored, so the outputs of a cache hit need no hashing in a later request: a CU that
reads only hits and model inputs gets its key from keys alone (hash chaining). Keys stay content
keys either way, so a tensor hashed from its bytes and one chained from a hit agree.

Entries are host copies, read-only, so neither a caller nor a device writing into its inputs can
change what the cache holds. The cache is least-recently-used, bounded by the bytes of the
outputs it holds; an entry larger than the whole budget is never stored.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

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
    outputs: dict[str, np.ndarray]      # read-only host copies
    output_keys: dict[str, bytes]
    nbytes: int


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

    def put(self, key: bytes, outputs: dict[str, np.ndarray]) -> CacheEntry | None:
        """Store `outputs`, host arrays the cache takes over (a device's `to_host` copies), made
        read-only, with their keys; None when they exceed the whole budget. Least recently used
        entries go first to make room."""
        copies, keys, nbytes = {}, {}, 0
        for name, array in outputs.items():
            copies[name] = array = read_only(array)
            nbytes += array.nbytes
        if not self.fits(nbytes):
            return None
        for name, array in copies.items():
            keys[name] = hash_tensor(array)
        entry = CacheEntry(copies, keys, nbytes)
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

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "budget_bytes": self.budget_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}
