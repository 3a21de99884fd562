// dag.json (`cortex.dag/1`) as this runtime reads it: the checks that keep a run from failing
// halfway (the schema version, an artifact for every CU, files inside dag.json's folder). The
// Python side validates the whole JSON Schema when it writes the file.
import { CortexError } from "./errors.js";
import { fileUrl } from "./loader.js";

export const DAG_SCHEMA = "cortex.dag/1";

/** @typedef {{name: string, offset: number, bytes: number, dtype: string, shape: number[],
 *             bound?: {axis: number, length_offset: number}}} PlanEntry */
/** @typedef {{memory_bytes: number, inputs: PlanEntry[], outputs: PlanEntry[]}} MemoryPlan */
/** @typedef {{path: string, sha256: string, bytes: number, options: {features: string[]}, memory: MemoryPlan}} WasmRecord */
/** @typedef {{id: string, path: string, sha256: string, inputs: string[], outputs: string[], op_types?: string[],
 *             artifacts?: {wasm?: WasmRecord}, runs_on?: string, activation?: {tensor: string, equals: boolean},
 *             random?: boolean}} CU */
/** @typedef {{name: string, dtype: string, shape: number[]}} TensorSpec */
/** @typedef {{schema: string, inputs: TensorSpec[], outputs: TensorSpec[], cus: CU[], order: string[],
 *             tensors: Record<string, {dtype: string, shape: number[], bytes: number, producer: string|null}>,
 *             selects?: {tensor: string, condition: string, cases: {equals: boolean, tensor: string}[]}[]}} Dag */

const FALLBACK_RUNTIMES = ["onnxruntime"];

/** Throws one error naming the file and what is wrong. @param {any} dag @param {URL} url @returns {Dag} */
export function checkDag(dag, url) {
  const where = url.href;
  if (typeof dag !== "object" || dag === null || Array.isArray(dag)) throw new CortexError(`${where}: not a dag.json`);
  if (dag.schema !== DAG_SCHEMA) {
    throw new CortexError(`${where}: schema ${JSON.stringify(dag.schema)} is not ${DAG_SCHEMA} (rebuild it with cortex build-dag)`);
  }
  for (const key of ["inputs", "outputs", "cus", "order"]) {
    if (!Array.isArray(dag[key])) throw new CortexError(`${where}: '${key}' is missing or not a list`);
  }
  if (typeof dag.tensors !== "object" || dag.tensors === null) throw new CortexError(`${where}: 'tensors' is missing`);
  const ids = new Set(dag.cus.map((/** @type {CU} */ cu) => cu.id));
  const unknown = dag.order.filter((/** @type {string} */ id) => !ids.has(id));
  if (unknown.length) throw new CortexError(`${where}: order names unknown CU ${unknown.join(", ")}`);
  for (const cu of dag.cus) {
    if (cu.runs_on !== undefined) {
      if (!FALLBACK_RUNTIMES.includes(cu.runs_on)) {
        throw new CortexError(`${where}: ${cu.id} runs on '${cu.runs_on}', which this runtime does not know`);
      }
      fileUrl(url, cu.path, cu.id);
      continue;
    }
    const record = cu.artifacts?.wasm;
    if (!record) {
      throw new CortexError(`${where}: ${cu.id} has no wasm artifact; run 'cortex compile-wasm --dag ${where}' first`);
    }
    fileUrl(url, record.path, cu.id);
  }
  return dag;
}

/** The union of the features a dag's modules were built with. @param {Dag} dag */
export function wasmRecords(dag) {
  return dag.cus.filter((cu) => cu.runs_on === undefined).map((cu) => /** @type {WasmRecord} */ (cu.artifacts?.wasm));
}
