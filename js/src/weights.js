// Weights outside the modules (compile-wasm --external-weights, always for shape specializations,
// backends/wasm/weights_files.py): content-addressed files that a CU's record lists as
// {path, offset, bytes, sha256}. Each file is read once per session however many CUs and
// specializations name it, its sha256 checked once, and written into each CU's memory at its
// offset after the CU is instantiated. They stream in alongside the modules, all at once; in a
// browser a checked file is kept in the Cache API beside the modules (js/src/module_cache.js), so a
// later visit reads it from there.
import { CortexError } from "./errors.js";
import { fileUrl } from "./loader.js";
import { readBytesCounted } from "./progress.js";
import { sha256Hex } from "./sha256.js";

/** @typedef {{path: string, offset: number, bytes: number, sha256: string}} WeightEntry */

export class WeightFiles {
  /** @param {URL} base dag.json's URL @param {import("./progress.js").LoadProgress | null} [progress]
   *  create's progress, told of each file's bytes as they arrive
   *  @param {import("./module_cache.js").ModuleCache | null} [cache] where checked files are kept between
   *  visits (the Cache API, beside the modules) */
  constructor(base, progress = null, cache = null) {
    this.base = base;
    this.progress = progress;
    this.cache = cache;
    /** @type {Map<string, Promise<Uint8Array>>} path -> its checked bytes */
    this.files = new Map();
    /** False under a memory budget: a file is read and checked for each load of a CU that names
     * it and not kept, so the host never holds the weights of CUs that are not resident. */
    this.keep = true;
  }

  /** The checked bytes of one file, read on first use. @param {WeightEntry} entry @param {string} cuId */
  read(entry, cuId) {
    const progress = this.progress;
    const onBytes = progress === null ? null : (/** @type {number} */ read) => progress.advance(entry.path, read);
    if (!this.keep) return this.checked(entry, cuId, onBytes);
    let bytes = this.files.get(entry.path);
    if (bytes === undefined) {
      bytes = this.checked(entry, cuId, onBytes);
      this.files.set(entry.path, bytes);
    }
    return bytes;
  }

  /** A file's bytes: from the cache where this runtime stored them checked, else read and checked
   * (then stored). @param {WeightEntry} entry @param {string} cuId @param {((read: number) => void) | null} onBytes */
  async checked(entry, cuId, onBytes) {
    const url = fileUrl(this.base, entry.path, cuId);
    const stored = this.cache === null ? null : await this.cache.storedWeights(url, entry.sha256, entry.bytes);
    if (stored !== null) {
      this.progress?.fileRead(entry.path);
      return stored;
    }
    const data = await checked(url, entry, cuId, onBytes);
    this.cache?.storeWeights(url, entry.sha256, data);
    return data;
  }

  /** Reads (and checks) every file the records name, each once. @param {import("./dag.js").CU[]} cus */
  async readAll(cus) {
    await Promise.all(cus.flatMap((cu) => (cu.artifacts?.wasm?.weights ?? []).map((w) => this.read(w, cu.id))));
  }

  /** Writes a CU's weights into its memory. @param {import("./dag.js").CU} cu @param {WebAssembly.Memory} memory */
  async write(cu, memory) {
    for (const entry of cu.artifacts?.wasm?.weights ?? []) {
      const data = await this.read(entry, cu.id);
      if (entry.offset + entry.bytes > memory.buffer.byteLength) {
        throw new CortexError(`${cu.id}: its weights ${entry.path} end at byte ${entry.offset + entry.bytes}, past its `
          + `memory's ${memory.buffer.byteLength} (recompile with cortex compile-wasm)`);
      }
      new Uint8Array(memory.buffer, entry.offset, entry.bytes).set(data);
    }
  }

  /** Drops the host copies once every CU that needs them holds its own. */
  release() {
    this.files.clear();
  }
}

/** @param {URL} url @param {WeightEntry} entry @param {string} cuId @param {((read: number) => void) | null} onBytes */
async function checked(url, entry, cuId, onBytes) {
  const data = await readBytesCounted(url, entry.bytes, onBytes);
  const sha = await sha256Hex(data);
  if (data.byteLength !== entry.bytes || sha !== entry.sha256) {
    throw new CortexError(`${url.href}: sha256 ${sha} (${data.byteLength} bytes) is not the ${entry.sha256} `
      + `(${entry.bytes} bytes) that dag.json records for the weights of ${cuId} (a stale or tampered file: `
      + "recompile with cortex compile-wasm)");
  }
  return data;
}
