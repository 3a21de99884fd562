// The result cache, with the Python runtime's semantics (cortex/runtime/cache.py): a CU whose
// inputs are byte-identical to an earlier run's hands back that run's outputs without running.
// A tensor's key hashes its dtype, shape and bytes; a CU's key hashes its identity (id, device,
// its cu.onnx sha256, its artifact record) and its inputs' keys in order. Keys are SHA-256 here
// (SubtleCrypto is what every engine has), xxh3_128 in Python: each runtime's cache is its own,
// so the two never compare keys. Least recently used first out, bounded by bytes.
// Chaining differs from Python's on purpose: an output's key is derived from its CU's key and its
// name (`outputKey`), not hashed from its bytes. A CU is a pure function of its inputs, so the
// same CU key means the same output bytes, and the CUs after it get their keys without hashing:
// on MiniLM, hashing each output with SHA-256 made a balanced request that misses cost 1.4x a
// strict one. What is lost: two different inputs whose CU writes byte-identical outputs (a Relu
// that zeroes both) do not meet in one key downstream, as they do in Python. Outputs of CUs that
// have no key (random ones, variants) are hashed from their bytes when a later CU needs a key.
import { digest, hex } from "./sha256.js";
import { Tensor, bytesOf } from "./tensor.js";

// As in Python (DEFAULT_CACHE_BYTES): room for the repeating part of a typical request in a browser tab.
export const DEFAULT_CACHE_BYTES = 256 * 2 ** 20;

const encoder = new TextEncoder();

/** The bytes' digest, then the header with it: no copy of the bytes.
 * @param {{type: string, dims: readonly number[], data: ArrayBufferView}} tensor @returns {Promise<string>} */
export async function tensorKey(tensor) {
  const body = hex(await digest(bytesOf(tensor)));
  return hex(await digest(encoder.encode(`${tensor.type}[${tensor.dims.join(",")}]\n${body}`)));
}

/** The key of output `name` of the CU run under `key` (never equal to a content key, which is
 * bare hex). @param {string} key @param {string} name */
export const outputKey = (key, name) => `${key}/${name}`;

/** @param {string} identity @param {string[]} inputKeys */
export async function cuKey(identity, inputKeys) {
  return hex(await digest(encoder.encode([identity, ...inputKeys].join("\n"))));
}

/** A host copy of a tensor, which neither a CU's next run nor a caller can change. @param {Tensor} tensor */
export function copied(tensor) {
  return new Tensor(tensor.type, tensor.data.slice(), tensor.dims);
}

/** @typedef {{outputs: Record<string, Tensor>, outputKeys: Record<string, string>, nbytes: number,
 *             byReference: boolean}} CacheEntry */

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

  /** Stores copies of `outputs` with their keys, or with `byReference` the views themselves (of a
   * CU's output slots: the scheduler calls `materialize` before that CU runs again); undefined when
   * they exceed the whole budget. @param {string} key @param {Record<string, Tensor>} outputs
   * @param {boolean} [byReference] */
  put(key, outputs, byReference = false) {
    const nbytes = Object.values(outputs).reduce((n, t) => n + t.data.byteLength, 0);
    if (!this.fits(nbytes)) return undefined;
    const copies = byReference ? { ...outputs }
      : Object.fromEntries(Object.entries(outputs).map(([name, t]) => [name, copied(t)]));
    const outputKeys = Object.fromEntries(Object.keys(copies).map((name) => [name, outputKey(key, name)]));
    const old = this.entries.get(key);
    if (old !== undefined) {
      this.entries.delete(key);
      this.nbytes -= old.nbytes;
    }
    this.evictDownTo(this.budgetBytes - nbytes);
    const entry = { outputs: copies, outputKeys, nbytes, byReference };
    this.entries.set(key, entry);
    this.nbytes += nbytes;
    return entry;
  }

  /** The entry under `key`, if still held and made of views, as host copies. @param {string} key */
  materialize(key) {
    const entry = this.entries.get(key);
    if (entry === undefined || !entry.byReference) return;
    entry.outputs = Object.fromEntries(Object.entries(entry.outputs).map(([name, t]) => [name, copied(t)]));
    entry.byReference = false;
  }

  /** A new bound: the least recently used out until the entries fit it. @param {number} budgetBytes */
  resize(budgetBytes) {
    this.budgetBytes = budgetBytes;
    this.evictDownTo(budgetBytes);
  }

  /** The least recently used entries out until the rest hold at most `bytes`. @param {number} bytes */
  evictDownTo(bytes) {
    for (const [oldest, entry] of this.entries) {
      if (this.nbytes <= bytes) break;
      this.entries.delete(oldest);
      this.nbytes -= entry.nbytes;
      this.evictions += 1;
    }
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
