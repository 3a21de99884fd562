// Prompt prefixes already computed, in the result cache (js/src/cache.js): the Python runtime's
// prefix cache (cortex/generation/prefix_cache.py) for `session.generate`.
//
// A prompt is split into whole chunks of the largest prefill length from its first token; chunk i
// is keyed by the hash chain key_i = SHA-256(key_(i-1) || its ids as little-endian int64), key_0
// the SHA-256 of the model's dag.json document, so a key names the chunk, everything before it and
// the model. SHA-256 because SubtleCrypto is the one hash every engine has (Python uses xxh3_128:
// the two runtimes' caches never meet). The value is what running the chunk left in the key/value
// cache: copies of its rows of every past buffer, so a prompt that starts with cached chunks
// restores their rows and runs none of their steps.
import { ResultCache } from "./cache.js";
import { CortexError } from "./errors.js";
import { digest, hex } from "./sha256.js";
import { Tensor } from "./tensor.js";

export const MB = 2 ** 20;
// As in Python (DEFAULT_PREFIX_CACHE_MB): about 10,900 tokens of Qwen2.5-0.5B's cache (24 layers x key
// and value x 2 heads x 64 x float32 = 24 KiB a token).
export const DEFAULT_PREFIX_CACHE_MB = 256;

/** The bound in bytes for `prefixCacheMB` (0 turns the cache off). @param {any} megabytes */
export function prefixCacheBytes(megabytes) {
  if (typeof megabytes !== "number" || !(megabytes >= 0) || megabytes === Infinity) {
    throw new CortexError(`prefixCacheMB must be a number of megabytes, at least 0 (got ${JSON.stringify(megabytes)})`);
  }
  return Math.floor(megabytes * MB);
}

/** key_0: the model's identity. @param {any} document dag.json as read @returns {Promise<Uint8Array>} */
export async function modelKey(document) {
  return new Uint8Array(await digest(new TextEncoder().encode(JSON.stringify(document))));
}

/** The keys of the prompt's whole chunks of `chunk` ids, in order.
 * @param {Uint8Array} root key_0 @param {number[]} ids @param {number} chunk @returns {Promise<Uint8Array[]>} */
export async function chunkKeys(root, ids, chunk) {
  const keys = [];
  let key = root;
  for (let start = 0; start + chunk <= ids.length; start += chunk) {
    const message = new Uint8Array(key.length + 8 * chunk);
    message.set(key);
    const view = new DataView(message.buffer, key.length);
    for (let i = 0; i < chunk; i++) view.setBigInt64(8 * i, BigInt(ids[start + i]), true);
    key = new Uint8Array(await digest(message));
    keys.push(key);
  }
  return keys;
}

/** @typedef {Map<string, Float32Array>} ChunkRows past input -> its rows of one chunk, [heads, chunk, head size] */

/** The runtime's result cache (bounded in bytes, least recently used out) holding chunks' rows by
 * their chain keys, as Python's prefix cache is. */
export class PrefixCache extends ResultCache {
  /** A chunk's rows (the cache's own: copy them out), or undefined. @param {Uint8Array} key
   * @returns {ChunkRows | undefined} */
  rows(key) {
    const entry = this.get(hex(key.buffer));
    return entry === undefined ? undefined : new Map(Object.entries(entry.outputs).map(([name, t]) => [name, t.data]));
  }

  /** Keeps `rows` (copies the caller gives away) under `key`. @param {Uint8Array} key @param {ChunkRows} rows */
  keep(key, rows) {
    const name = hex(key.buffer);
    if (this.entries.has(name)) return;
    this.put(name, Object.fromEntries([...rows].map(([past, data]) => [past, new Tensor("float32", data, [data.length])])),
      true);
  }

  stats() {
    const { budget_bytes: maxBytes, ...counts } = super.stats();
    return { ...counts, maxBytes };
  }
}
