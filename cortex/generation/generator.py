"""Token-by-token generation over a model compiled for it (`--kv-buckets`, cortex/decoder_io.py): one
specialization per (new tokens S, past bucket P), the key/value cache in the runtime.

A step of S tokens at cache length L, bucket P (L + S <= P) feeds the past buffers whole and:
- shared-buffer models: a mask [1, P] of ones up to L + S (the attention takes the cache length
  from it); the step's rows are present[:, :, L:L+S];
- concat models: a mask [1, P + S] of ones before L and from P on (the buffer's padding is hidden);
  position_ids L .. L+S-1; the step's rows are present[:, :, P:P+S];
then writes only those rows into the cache. Padded positions are masked, so a step in a larger
bucket computes the same values, up to the order of the attention's sums.

A prompt runs as chunks: whole chunks of the largest prefill length from its first token (these key
the prefix cache), then smaller chunks, then single tokens. Its bucket is the smallest that holds
the whole prompt, with or without a prefix-cache hit, so a hit gives bitwise the logits of the
same prefill without the cache. Decoding moves to the next bucket (one copy) when the cache is full,
and stops at the largest.

The cache's bytes at the largest bucket are taken out of `--memory-budget` before the CUs get the
rest, so the budget bounds both."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import xxhash

from cortex.decoder_io import CONCAT, MASK, POSITIONS, SHARED, TOKENS, DecoderIO, decoder_io
from cortex.generation.kv_cache import KVCache
from cortex.generation.prefix_cache import PrefixCache, chunk_keys
from cortex.generation.sampling import Sampling, TokenSampler
from cortex.runtime import load
from cortex.runtime.memory import MB
from cortex.runtime.options import RuntimeOptions
from cortex.specializations import read_specialized_dag
from ir.errors import CortexError

DEFAULT_PREFIX_CACHE_MB = 256


class Generator:
    def __init__(self, dag_path: Path, device: str = "wasm", options: RuntimeOptions | None = None,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB):
        self.dag_path = Path(dag_path)
        dag = read_specialized_dag(self.dag_path)
        self.steps, self.io = _steps(dag, str(self.dag_path))
        self.buckets = sorted({p for _, p in self.steps})
        self.chunks = sorted({s for s, _ in self.steps if s > 1}, reverse=True)
        first = dag["specializations"][0]
        self.dtypes = {i["name"]: np.dtype(i["dtype"]) for i in first["inputs"]}
        self.vocab = next(o["shape"][-1] for o in first["outputs"] if o["name"] == self.io.logits)
        self.kv_dtype = self.dtypes[self.io.past[0]]
        self.kv_heads, self.head_size = first["input_shapes"][self.io.past[0]][1], first["input_shapes"][self.io.past[0]][3]
        # each step's past differs from the last, so the result cache would only hash it
        options = options or RuntimeOptions(cache_bytes=0)
        self.kv_bytes_max = KVCache.bytes_for(self.io.past, self.kv_heads, self.head_size, self.buckets[-1], self.kv_dtype)
        if options.memory_budget_mb is not None:
            left = options.memory_budget_mb - self.kv_bytes_max / MB
            if left <= 0:
                raise CortexError(f"--memory-budget {options.memory_budget_mb:g} MB does not hold the key/value "
                                  f"cache ({self.kv_bytes_max / MB:.1f} MB at {self.buckets[-1]} tokens)")
            options = replace(options, memory_budget_mb=left)
        self.model = load(self.dag_path, device, options=options)
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * MB))
        self.root = xxhash.xxh3_128(json.dumps(dag, sort_keys=True).encode()).digest()
        self.trace: dict = {}

    def close(self) -> None:
        self.model.close()

    def generate(self, prompt_ids, max_new_tokens: int = 32, sampling: Sampling = Sampling(),
                 stop_ids=(), observe=None) -> Iterator[int]:
        """The new tokens, one at a time, as they are made; `observe(logits)` sees each logits row
        [vocab] a token is chosen from."""
        prompt = self._checked_prompt(prompt_ids)
        stop = {int(i) for i in stop_ids}
        if max_new_tokens < 0:
            raise CortexError(f"max new tokens must be >= 0, got {max_new_tokens}")
        sampler, started = TokenSampler(sampling), time.perf_counter()
        cache = KVCache(self.io.past, self.kv_heads, self.head_size, self._bucket_for(len(prompt)), self.kv_dtype)
        self.trace = {"prompt_tokens": len(prompt), "prefix_hit_tokens": 0, "prefill_steps": [],
                      "bucket": cache.bucket, "decode_ms": [], "finish": "length"}
        logits = self._prefill(prompt, cache)
        self.trace["ttft_ms"] = (time.perf_counter() - started) * 1e3
        for made in range(max_new_tokens):
            if observe is not None:
                observe(logits)
            token = sampler(logits)
            yield token
            if token in stop:
                self.trace["finish"] = "stop"
                break
            if made + 1 == max_new_tokens:
                break
            if cache.length + 1 > cache.bucket:
                if cache.bucket == self.buckets[-1]:
                    self.trace["finish"] = "context"
                    break
                cache.grow(self._bucket_for(cache.length + 1))
            step = time.perf_counter()
            logits = self._step(np.array([token]), cache)
            self.trace["decode_ms"].append((time.perf_counter() - step) * 1e3)
        memory = self.model.last_trace.get("memory", {}) if self.model.last_trace else {}
        self.trace.update(kv_bytes=cache.nbytes, kv_length=cache.length, bucket=cache.bucket,
                          bucket_growths=cache.growths, prefix_cache=self.prefix_cache.stats(),
                          memory={k: v for k, v in memory.items() if isinstance(v, (int, float))})

    def _checked_prompt(self, prompt_ids) -> np.ndarray:
        prompt = np.asarray(list(prompt_ids), np.int64).reshape(-1)
        if prompt.size == 0:
            raise CortexError("the prompt is empty: give at least one token id")
        bad = prompt[(prompt < 0) | (prompt >= self.vocab)]
        if bad.size:
            raise CortexError(f"token id {int(bad[0])} is outside the vocabulary of {self.vocab} ids")
        if prompt.size > self.buckets[-1]:
            raise CortexError(f"the prompt has {prompt.size} tokens, more than the largest key/value bucket "
                              f"({self.buckets[-1]}; build with a larger --kv-buckets)")
        return prompt

    def _bucket_for(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def _prefill(self, prompt: np.ndarray, cache: KVCache) -> np.ndarray:
        largest = self.chunks[0] if self.chunks else None
        keys = chunk_keys(self.root, prompt, largest) if largest else []
        # a cached chunk is restored only when a token is left to run: its logits are not kept
        for key in keys[:(len(prompt) - 1) // largest if largest else 0]:
            rows = self.prefix_cache.rows(key)
            if rows is None:
                break
            cache.append(rows)
        self.trace["prefix_hit_tokens"] = cache.length
        logits = None
        while cache.length < len(prompt):
            left = len(prompt) - cache.length
            size = next((c for c in self.chunks if c <= left and (cache.length % largest == 0 or c < largest)), 1)
            start = cache.length
            logits = self._step(prompt[start:start + size], cache)
            self.trace["prefill_steps"].append(size)
            if size == largest and keys[start // largest] not in self.prefix_cache.entries:
                self.prefix_cache.put(keys[start // largest], cache.rows(start, start + size))
        return logits

    def _step(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        tokens, bucket, length = len(ids), cache.bucket, cache.length
        if (tokens, bucket) not in self.steps:
            raise CortexError(f"{self.dag_path}: no specialization for {tokens} new tokens at a {bucket}-token past")
        rows_only = self.steps[(tokens, bucket)]
        feeds = {TOKENS: ids.reshape(1, tokens).astype(self.dtypes[TOKENS]), **cache.buffers}
        if self.io.layout == SHARED:
            mask = np.zeros((1, bucket), self.dtypes[MASK])
            mask[0, :length + tokens] = 1
            start = 0 if rows_only else length
        else:
            mask = np.zeros((1, bucket + tokens), self.dtypes[MASK])
            mask[0, :length] = 1
            mask[0, bucket:] = 1
            start = 0 if rows_only else bucket
        feeds[MASK] = mask
        if self.io.has_positions:
            feeds[POSITIONS] = np.arange(length, length + tokens).reshape(1, tokens).astype(self.dtypes[POSITIONS])
        outputs = self.model.run(feeds, outputs=[self.io.logits, *self.io.present])
        cache.append({past: outputs[present][:, :, start:start + tokens]
                      for past, present in zip(self.io.past, self.io.present)})
        return outputs[self.io.logits][0, -1]


def _steps(dag: dict, label: str) -> tuple[dict[tuple[int, int], bool], DecoderIO]:
    """(new tokens, past bucket) -> whether present is only the step's rows (as `--kv-buckets`
    builds it), and the decoder interface, its layout read from the mask: as long as the past
    (shared buffer) or the past and the new tokens (concat)."""
    steps, io = {}, None
    for section in dag["specializations"]:
        shapes = section["input_shapes"]
        outputs = {o["name"]: o["shape"] for o in section["outputs"]}
        probe = io or decoder_io(shapes, outputs, label, SHARED)
        tokens, bucket = shapes[TOKENS][1], shapes[probe.past[0]][2]
        mask, present = shapes[MASK][1], outputs[probe.present[0]][2]
        layout = SHARED if mask == bucket else CONCAT if mask == bucket + tokens else None
        whole = bucket if layout == SHARED else bucket + tokens
        if layout is None or shapes[TOKENS][0] != 1 or present not in (tokens, whole):
            raise CortexError(f"{label}: specialization {section['name']} is not a generation step (batch 1, "
                              "a mask as long as the past or the past and the new tokens, present as long as the "
                              "new tokens or the mask)")
        if io is not None and layout != io.layout:
            raise CortexError(f"{label}: the specializations disagree on how the cache is masked")
        io = io or replace(probe, layout=layout)
        # a shared buffer as long as the step (P = S) holds its rows from 0, as a rows build does
        steps[(tokens, bucket)] = present == tokens
    if 1 not in {t for t, _ in steps}:
        raise CortexError(f"{label}: no one-token specialization to decode with (build with --kv-buckets)")
    return steps, io
