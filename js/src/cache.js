// The result cache, with the Python runtime's semantics (cortex/runtime/cache.py): a CU whose
// inputs are byte-identical to an earlier run's hands back that run's outputs without running.
// A tensor's key hashes its dtype, shape and bytes; a CU's key hashes its identity (id, device,
// its cu.onnx sha256, its artifact record) and its inputs' keys in order; an entry keeps its
// outputs' keys, so the CUs after a hit get theirs without hashing bytes (chaining). Keys are
// SHA-256 here (SubtleCrypto is what every engine has), xxh3_128 in Python: each runtime's cache
// is its own, so the two never compare keys. Least recently used first out, bounded by bytes.
import { digest, hex } from "./sha256.js";
import { Tensor, bytesOf } from "./tensor.js";

// As in Python (DEFAULT_CACHE_BYTES): room for the repeating part of a typical request in a browser tab.
export const DEFAULT_CACHE_BYTES = 256 * 2 ** 20;

const encoder = new TextEncoder();

/** @param {{type: string, dims: readonly number[], data: ArrayBufferView}} tensor @returns {Promise<string>} */
export async function tensorKey(tensor) {
  const header = encoder.encode(`${tensor.type}[${tensor.dims.join(",")}]`);
  const body = bytesOf(tensor);
  const joined = new Uint8Array(header.length + body.length);
  joined.set(header);
  joined.set(body, header.length);
  return hex(await digest(joined));
}

/** @param {string} identity @param {string[]} inputKeys */
export async function cuKey(identity, inputKeys) {
  return hex(await digest(encoder.encode([identity, ...inputKeys].join("\n"))));
}

/** A host copy of a tensor, which neither a CU's next run nor a caller can change. @param {Tensor} tensor */
export function copied(tensor) {
  return new Tensor(tensor.type, tensor.data.slice(), tensor.dims);
}

/** @typedef {{outputs: Record<string, Tensor>, outputKeys: Record<string, string>, nbytes: number}} CacheEntry */

export class ResultCache {
  /** @param {number} budgetBytes */
  constructor(budgetBytes = DEFAULT_CACHE_BYTES) {
    this.budgetBytes = budgetBytes;
    /** @type {Map<string, CacheEntry>} in use order, oldest first */
    this.entries = new Map();
    this.nbytes = 0;
    this.hits = 0;
    this.misses = 0;
    this.evictions = 0;
  }

  get enabled() {
    return this.budgetBytes > 0;
  }

  /** @param {number} nbytes */
  fits(nbytes) {
    return nbytes <= this.budgetBytes;
  }

  /** @param {string} key */
  get(key) {
    const entry = this.entries.get(key);
    if (entry === undefined) {
      this.misses += 1;
      return undefined;
    }
    this.entries.delete(key);
    this.entries.set(key, entry);
    this.hits += 1;
    return entry;
  }

  /** Stores copies of `outputs` with their keys; undefined when they exceed the whole budget.
   * @param {string} key @param {Record<string, Tensor>} outputs */
  async put(key, outputs) {
    const copies = Object.fromEntries(Object.entries(outputs).map(([name, t]) => [name, copied(t)]));
    const nbytes = Object.values(copies).reduce((n, t) => n + t.data.byteLength, 0);
    if (!this.fits(nbytes)) return undefined;
    /** @type {Record<string, string>} */
    const outputKeys = {};
    for (const [name, t] of Object.entries(copies)) outputKeys[name] = await tensorKey(t);
    const old = this.entries.get(key);
    if (old !== undefined) {
      this.entries.delete(key);
      this.nbytes -= old.nbytes;
    }
    for (const [oldest, entry] of this.entries) {
      if (this.nbytes + nbytes <= this.budgetBytes) break;
      this.entries.delete(oldest);
      this.nbytes -= entry.nbytes;
      this.evictions += 1;
    }
    const entry = { outputs: copies, outputKeys, nbytes };
    this.entries.set(key, entry);
    this.nbytes += nbytes;
    return entry;
  }

  clear() {
    this.entries.clear();
    this.nbytes = 0;
  }

  stats() {
    return { entries: this.entries.size, bytes: this.nbytes, budget_bytes: this.budgetBytes, hits: this.hits,
      misses: this.misses, evictions: this.evictions };
  }
}
