"""The key/value cache of one generation, held by the runtime: per past input one buffer
[1, KVH, P, HD] for the current bucket P, filled up to `length`, zeros after.

A step writes only its new rows (at `length`); moving to a larger bucket copies the buffers once.
The buffers are fed to the model as its past inputs, which is what onnxruntime-genai's shared
past/present buffer does too."""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, names: tuple[str, ...], kv_heads: int, head_size: int, bucket: int, dtype=np.float32):
        self.names, self.kv_heads, self.head_size, self.dtype = names, kv_heads, head_size, np.dtype(dtype)
        self.bucket, self.length, self.growths = bucket, 0, 0
        self.buffers = {name: self._zeros(bucket) for name in names}

    def _zeros(self, bucket: int) -> np.ndarray:
        return np.zeros((1, self.kv_heads, bucket, self.head_size), self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    @staticmethod
    def bytes_for(names, kv_heads: int, head_size: int, bucket: int, dtype=np.float32) -> int:
        return len(names) * kv_heads * bucket * head_size * np.dtype(dtype).itemsize

    def grow(self, bucket: int) -> None:
        for name, old in self.buffers.items():
            new = self._zeros(bucket)
            new[:, :, :self.length] = old[:, :, :self.length]
            self.buffers[name] = new
        self.bucket = bucket
        self.growths += 1

    def append(self, rows: dict[str, np.ndarray]) -> None:
        count = next(iter(rows.values())).shape[2]
        for name, new in rows.items():
            self.buffers[name][:, :, self.length:self.length + count] = new
        self.length += count

    def rows(self, start: int, end: int) -> dict[str, np.ndarray]:
        return {name: buffer[:, :, start:end].copy() for name, buffer in self.buffers.items()}
