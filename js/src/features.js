// The WebAssembly features a dag's modules were built with (recorded per artifact), checked against
// the engine before anything is compiled, so a missing one is one clear error instead of a
// CompileError on the first module.
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
  "relaxed-simd": " (Node 20 needs --experimental-wasm-relaxed-simd; or recompile with --features simd)",
};

/** The union of the features the wasm artifacts record. @param {any[]} records */
export function recordedFeatures(records) {
  return [...new Set(records.flatMap((r) => r.options?.features ?? []))].sort();
}

/** Throws when the engine lacks a feature the modules need. @param {string[]} features @param {string} where */
export function checkFeatures(features, where) {
  const missing = features.filter((f) => PROBES[f] && !WebAssembly.validate(new Uint8Array(PROBES[f])));
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
  try {
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 1, 0);
    return true;
  } catch {
    return false;
  }
}
