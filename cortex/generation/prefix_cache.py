"""Prompt prefixes already computed, bounded in bytes, least recently used first out.

A prompt is split into chunks of the largest prefill length from its first token; chunk i is keyed
by the hash chain h_i = xxh3_128(h_(i-1) || its token ids), h_0 the model's identity, so a key
names the chunk and everything before it (vLLM keys its KV blocks by their parent's hash the same
way). The value is what running that chunk left in the key/value cache: its rows of every past
buffer. A request whose prompt starts with cached chunks restores their rows and runs none of the
CUs of those chunks."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash


def chunk_keys(root: bytes, ids: np.ndarray, chunk: int) -> list[bytes]:
    """The keys of the prompt's whole chunks, in order."""
    keys, key = [], root
    for start in range(0, len(ids) - chunk + 1, chunk):
        key = xxhash.xxh3_128(key + np.ascontiguousarray(ids[start:start + chunk], np.int64).tobytes()).digest()
        keys.append(key)
    return keys


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, dict[str, np.ndarray]] = OrderedDict()
        self.bytes = self.hits = self.misses = self.evictions = 0

    def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        rows = self.entries.get(key)
        if rows is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return rows

    def put(self, key: bytes, rows: dict[str, np.ndarray]) -> None:
        size = sum(r.nbytes for r in rows.values())
        if key in self.entries or size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= sum(r.nbytes for r in dropped.values())
            self.evictions += 1
        self.entries[key] = rows
        self.bytes += size

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}
