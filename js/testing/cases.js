// The cases the Python tests compiled (tests/js_cases.py): CORTEX_JS_CASES names a JSON list of
// case.json files. Without it every test that needs a case is skipped.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { ARRAY_TYPES } from "../src/tensor.js";
import { Tensor } from "../src/index.js";

/** @returns {any[]} each case.json, with `dag` and each tensor's `file` made absolute */
export function loadCases() {
  const listing = process.env.CORTEX_JS_CASES;
  if (!listing) return [];
  return JSON.parse(readFileSync(listing, "utf8")).map((/** @type {string} */ file) => {
    const folder = path.dirname(file);
    const c = JSON.parse(readFileSync(file, "utf8"));
    c.dag = path.resolve(folder, c.dag);
    c.folder = folder;
    return c;
  });
}

export const SKIP = process.env.CORTEX_JS_CASES ? false : "CORTEX_JS_CASES is not set (tests/test_js_node.py sets it)";

/** @param {any} c @param {{dtype: string, shape: number[], file: string}} spec */
export function readTensor(c, spec) {
  const raw = readFileSync(path.join(c.folder, spec.file));
  const bytes = new Uint8Array(raw.byteLength);
  bytes.set(raw);
  return new Tensor(spec.dtype, new ARRAY_TYPES[spec.dtype](bytes.buffer), spec.shape);
}

/** @param {any} c @param {Record<string, any>} specs */
export function readTensors(c, specs) {
  return Object.fromEntries(Object.entries(specs).map(([name, spec]) => [name, readTensor(c, spec)]));
}

/** numpy's allclose for floats (|got - want| <= atol + rtol |want|), equality otherwise. */
export function assertClose(got, want, rtol, atol, label) {
  assert.equal(got.type, want.type, `${label}: dtype`);
  assert.deepEqual([...got.dims], [...want.dims], `${label}: shape`);
  const float = got.type.startsWith("float");
  let worst = 0, at = -1;
  for (let i = 0; i < want.data.length; i++) {
    const g = Number(got.data[i]), w = Number(want.data[i]);
    if (!float) {
      assert.equal(got.data[i], want.data[i], `${label}[${i}]`);
      continue;
    }
    const excess = Math.abs(g - w) - (atol + rtol * Math.abs(w));
    if (!(excess <= worst) && !(Number.isNaN(g) && Number.isNaN(w))) {
      worst = Number.isNaN(excess) ? Infinity : excess;
      at = i;
    }
  }
  assert.ok(at < 0, `${label}[${at}]: got ${got.data[at]}, want ${want.data[at]} (rtol ${rtol}, atol ${atol})`);
}

/** onnxruntime-web from the folder CORTEX_JS_ORTWEB names (bench/ortweb, where make installs it), or null. */
export async function onnxruntimeWeb() {
  const folder = process.env.CORTEX_JS_ORTWEB;
  if (!folder) return null;
  const entry = createRequire(path.join(folder, "package.json")).resolve("onnxruntime-web");
  const ort = await import(entry);
  const api = ort.InferenceSession ? ort : ort.default;
  api.env.wasm.numThreads = 1;
  api.env.logLevel = "error";
  return api;
}
