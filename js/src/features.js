// The WebAssembly features a dag's modules were built with (recorded per artifact), checked against
// the engine before anything is compiled, so a missing one is one clear error instead of a
// CompileError on the first module. A record may list alternate modules of the same CU built with
// other features (`compile-wasm --features simd,relaxed-simd;simd`): the engine runs the primary
// module when it has every feature of it, else the first alternate it has, as onnxruntime-web picks
// one of its builds by feature detection; only when none fits is the primary's lack an error.
import { CortexError } from "./errors.js";

// The smallest modules using each feature (from their WAT, assembled once).
const PROBES = {
  simd: [0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 123, 3, 2, 1, 0, 10, 22, 1, 20, 0, 253, 12,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 11],
  "relaxed-simd": [0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 123, 3, 2, 1, 0, 10, 43, 1, 41, 0, 253, 12,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 253, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    253, 128, 2, 11],
  "bulk-memory": [0, 97, 115, 109, 1, 0, 0, 0, 1, 4, 1, 96, 0, 0, 3, 2, 1, 0, 5, 3, 1, 0, 1, 10, 13, 1, 11,
    0, 65, 0, 65, 0, 65, 0, 252, 11, 0, 11],
  // a shared memory of one page and an i32.atomic.load
  threads: [0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 127, 3, 2, 1, 0, 5, 4, 1, 3, 1, 1, 10, 10, 1, 8, 0,
    65, 0, 254, 16, 2, 0, 11],
};

const HINTS = {
  "relaxed-simd": " (Node 20 needs --experimental-wasm-relaxed-simd; or recompile with --features simd, or with "
    + "--features \"simd,relaxed-simd;simd\" for a plain SIMD alternate)",
};

/** @type {Map<string, boolean>} feature -> whether this engine validates its probe */
const validated = new Map();

/** The features of `features` this engine lacks. @param {string[]} features */
function lacking(features) {
  return features.filter((f) => {
    if (!PROBES[f]) return false;
    if (!validated.has(f)) validated.set(f, WebAssembly.validate(new Uint8Array(PROBES[f])));
    return !validated.get(f);
  });
}

/** @type {WeakMap<object, any>} a record -> the record of the module this engine runs (null: none) */
const chosen = new WeakMap();

/** The record of the module of `record` this engine runs: `record` itself (less its alternates)
 * when the engine has all its features, else the first alternate it has all of, as a record of its
 * own (its file, sha256, size and features; its memory plan and weights where it records them, the
 * primary's otherwise); null when none fits. The same object for the same record.
 * @param {import("./dag.js").WasmRecord} record @returns {import("./dag.js").WasmRecord | null} */
export function runnableRecord(record) {
  let found = chosen.get(record);
  if (found === undefined) {
    const { alternates = [], ...primary } = record;
    found = [primary, ...alternates.map(({ features, ...module }) => ({ ...primary, ...module,
      options: { ...primary.options, features } }))]
      .find((r) => lacking(r.options?.features ?? []).length === 0) ?? null;
    chosen.set(record, found);
  }
  return found;
}

/** The union of the features of the modules this engine would run: of each record, its runnable
 * module's (`runnableRecord`), or its primary's when none fits (so `checkFeatures` names what the
 * engine lacks). @param {any[]} records */
export function recordedFeatures(records) {
  return [...new Set(records.flatMap((r) => (runnableRecord(r) ?? r).options?.features ?? []))].sort();
}

/** Throws when the engine lacks a feature the modules need. @param {string[]} features @param {string} where */
export function checkFeatures(features, where) {
  const missing = lacking(features);
  if (missing.length) {
    throw new CortexError(`${where}: the modules use WebAssembly ${missing.join(", ")}, which this engine lacks`
      + missing.map((f) => HINTS[f] ?? "").join(""));
  }
}

/** Whether this context may create a shared WebAssembly.Memory: a browser page only when it is
 * crossOriginIsolated (SharedArrayBuffer is withheld otherwise), Node and isolated pages always. */
export function sharedMemoryAvailable() {
  if (/** @type {any} */ (globalThis).crossOriginIsolated === false || typeof SharedArrayBuffer !== "function") return false;
  try {
    return new WebAssembly.Memory({ initial: 1, maximum: 1, shared: true }).buffer instanceof SharedArrayBuffer;
  } catch {
    return false;
  }
}

/** Whether this thread may block in `Atomics.wait` (a browser page's main thread may not): a CU's
 * caller waits there for its kernel threads' parts. */
export function mayBlock() {
  // Never a SharedArrayBuffer where it is withheld (a page that is not isolated).
  if (/** @type {any} */ (globalThis).crossOriginIsolated === false || typeof SharedArrayBuffer !== "function") return false;
  try {
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 1, 0);
    return true;
  } catch {
    return false;
  }
}
