"""Prompt prefixes already computed: the runtime's result cache (cortex/runtime/cache.py, bounded in
bytes, least recently used out) keyed by hash chains of prompt chunks.

A prompt is split into chunks of the largest prefill length from its first token; chunk i is keyed
by the hash chain h_i = xxh3_128(h_(i-1) || its token ids), h_0 the model's identity, so a key
names the chunk and everything before it (vLLM keys its KV blocks by their parent's hash the same
way). The entry is what running that chunk left in the key/value cache: its rows of every past
buffer. A request whose prompt starts with cached chunks restores their rows and runs none of the
CUs of those chunks."""

from __future__ import annotations

import numpy as np
import xxhash

from cortex.runtime.cache import ResultCache


def chunk_keys(root: bytes, ids: np.ndarray, chunk: int) -> list[bytes]:
    """The keys of the prompt's whole chunks, in order."""
    keys, key = [], root
    for start in range(0, len(ids) - chunk + 1, chunk):
        key = xxhash.xxh3_128(key + np.ascontiguousarray(ids[start:start + chunk], np.int64).tobytes()).digest()
        keys.append(key)
    return keys


class PrefixCache(ResultCache):
    def rows(self, key: bytes) -> dict[str, np.ndarray] | None:
        entry = self.get(key)
        return None if entry is None else entry.outputs
