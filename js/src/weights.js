// Weights outside the modules (compile-wasm --external-weights, always for shape specializations,
// backends/wasm/weights_files.py): content-addressed files that a CU's record lists as
// {path, offset, bytes, sha256}. Each file is read once per session however many CUs and
// specializations name it, its sha256 checked once, and written into each CU's memory at its
// offset after the CU is instantiated.
import { CortexError } from "./errors.js";
import { fileUrl, readBytes } from "./loader.js";
import { sha256Hex } from "./sha256.js";

/** @typedef {{path: string, offset: number, bytes: number, sha256: string}} WeightEntry */

export class WeightFiles {
  /** @param {URL} base dag.json's URL */
  constructor(base) {
    this.base = base;
    /** @type {Map<string, Promise<Uint8Array>>} path -> its checked bytes */
    this.files = new Map();
  }

  /** The checked bytes of one file, read on first use. @param {WeightEntry} entry @param {string} cuId */
  read(entry, cuId) {
    let bytes = this.files.get(entry.path);
    if (bytes === undefined) {
      bytes = checked(fileUrl(this.base, entry.path, cuId), entry, cuId);
      this.files.set(entry.path, bytes);
    }
    return bytes;
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

/** @param {URL} url @param {WeightEntry} entry @param {string} cuId */
async function checked(url, entry, cuId) {
  const data = await readBytes(url);
  const sha = await sha256Hex(data);
  if (data.byteLength !== entry.bytes || sha !== entry.sha256) {
    throw new CortexError(`${url.href}: sha256 ${sha} (${data.byteLength} bytes) is not the ${entry.sha256} `
      + `(${entry.bytes} bytes) that dag.json records for the weights of ${cuId} (a stale or tampered file: `
      + "recompile with cortex compile-wasm)");
  }
  return data;
}
