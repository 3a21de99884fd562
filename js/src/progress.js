// Load progress for `InferenceSession.create(url, {onProgress})`: the callback gets
// {bytes, totalBytes, cus, totalCus} as module and weight files are read and CUs loaded. The totals
// come from dag.json before anything is read (each wasm record carries its module's `bytes`, each
// weights entry its file's), so a page can draw a bar from the first call. A file counts once
// however many CUs name it, whether it came from the network, a file or the module cache, and a
// file read twice (a corrupt cache entry, then the network) never counts past its size: `bytes`
// and `cus` never decrease. Only create reports: a section or variant loaded on a later request
// does not call back. A callback that throws is not called again; create finishes its loads (so
// nothing is left half-read or half-cached) and then rejects with one line naming onProgress.
import { CortexError } from "./errors.js";
import { fetched, readBytes } from "./loader.js";
import { chosenVariant, variantRecord } from "./variants.js";

/** @typedef {{bytes: number, totalBytes: number, cus: number, totalCus: number}} ProgressEvent */

export class LoadProgress {
  /** @param {(event: ProgressEvent) => void} callback */
  constructor(callback) {
    this.callback = callback;
    /** @type {Map<string, number>} file path -> its recorded size */
    this.sizes = new Map();
    /** @type {Map<string, number>} file path -> bytes of it counted so far (at most its size) */
    this.counted = new Map();
    this.bytes = 0;
    this.totalBytes = 0;
    this.cus = 0;
    this.totalCus = 0;
    this.done = false;
    this.reported = false;
    /** @type {unknown} what the callback threw, if it did */
    this.thrown = undefined;
  }

  /** The files and units create reads and loads: every section's modules and weight files (all
   * are fetched and checked at create), section 0's CUs and the variants `policy` picks there
   * (instantiated at create). Under the offline policy create reads none of them.
   * @param {import("./dag.js").Section[]} sections @param {import("./policy.js").Policy} policy */
  plan(sections, policy) {
    if (policy.offline) return;
    /** @param {import("./dag.js").WasmRecord | undefined} record */
    const add = (record) => {
      if (record === undefined) return;
      this.sizes.set(record.path, Number(record.bytes) || 0);
      for (const w of record.weights ?? []) this.sizes.set(w.path, Number(w.bytes) || 0);
    };
    for (const { dag } of sections) for (const cu of dag.cus) if (cu.runs_on === undefined) add(cu.artifacts?.wasm);
    const first = sections[0].dag.cus;
    this.totalCus = first.length;
    for (const cu of first) {
      const precision = chosenVariant(cu, policy.trustThreshold);
      if (precision === null) continue;
      add(variantRecord(cu, precision).artifacts?.wasm);
      this.totalCus += 1;
    }
    for (const size of this.sizes.values()) this.totalBytes += size;
  }

  /** `read` bytes of `path` have arrived in the current attempt at it. @param {string} path @param {number} read */
  advance(path, read) {
    const size = this.sizes.get(path);
    if (this.done || size === undefined) return;
    const before = this.counted.get(path) ?? 0;
    const now = Math.min(size, Math.max(before, read));
    if (now === before) return;
    this.counted.set(path, now);
    this.bytes += now - before;
    this.report();
  }

  /** `path` is read and checked whole. @param {string} path */
  fileRead(path) {
    this.advance(path, this.sizes.get(path) ?? 0);
  }

  /** One more CU (or variant) is loaded. */
  cuLoaded() {
    if (this.done || this.cus >= this.totalCus) return;
    this.cus += 1;
    this.report();
  }

  /** The last call, at the totals (only where the counts fell short of them: a unit the plan did
   * not foresee), then no more. Throws what the callback threw, as one line. */
  finish() {
    if (this.done) return;
    if (!this.reported || this.bytes !== this.totalBytes || this.cus !== this.totalCus) {
      [this.bytes, this.cus] = [this.totalBytes, this.totalCus];
      this.report();
    }
    this.done = true;
    if (this.thrown !== undefined) {
      throw new CortexError(`onProgress threw: ${/** @type {any} */ (this.thrown)?.message ?? this.thrown}`);
    }
  }

  /** Stops calling back (create failed: its error is the one to see). */
  stop() {
    this.done = true;
  }

  report() {
    if (this.thrown !== undefined) return;
    this.reported = true;
    try {
      this.callback({ bytes: this.bytes, totalBytes: this.totalBytes, cus: this.cus, totalCus: this.totalCus });
    } catch (e) {
      this.thrown = e ?? new Error(String(e));
    }
  }
}

/** The create option, checked: a LoadProgress, or null without one. @param {unknown} onProgress */
export function loadProgress(onProgress) {
  if (onProgress === undefined || onProgress === null) return null;
  if (typeof onProgress !== "function") {
    throw new CortexError(`onProgress must be a function called with {bytes, totalBytes, cus, totalCus} (got ${typeof onProgress})`);
  }
  return new LoadProgress(/** @type {(event: ProgressEvent) => void} */ (onProgress));
}

/** A response's body, read in chunks, `onBytes` told the running count after each.
 * @param {Response} response @param {number} expected the recorded size (the buffer grows past it)
 * @param {(read: number) => void} onBytes @returns {Promise<Uint8Array>} */
export async function readCounted(response, expected, onBytes) {
  if (response.body === null) return new Uint8Array(0);
  const reader = response.body.getReader();
  let buffer = new Uint8Array(Math.max(expected, 0));
  let read = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (read + value.byteLength > buffer.byteLength) {
      const larger = new Uint8Array(Math.max(buffer.byteLength * 2, read + value.byteLength));
      larger.set(buffer.subarray(0, read));
      buffer = larger;
    }
    buffer.set(value, read);
    read += value.byteLength;
    onBytes(read);
  }
  return read === buffer.byteLength ? buffer : buffer.subarray(0, read);
}

/** A file's bytes as `readBytes` reads them, counted as they arrive over http.
 * @param {URL} url @param {number} expected @param {((read: number) => void) | null} onBytes */
export async function readBytesCounted(url, expected, onBytes) {
  if (onBytes === null || url.protocol === "file:") {
    const data = await readBytes(url);
    onBytes?.(data.byteLength);
    return data;
  }
  return readCounted(await fetched(url), expected, onBytes);
}

/** `unit`, counted as loaded when it is. @template T @param {LoadProgress | null} progress @param {Promise<T>} unit */
export function counted(progress, unit) {
  return progress === null ? unit : unit.then((loaded) => {
    progress.cuLoaded();
    return loaded;
  });
}
