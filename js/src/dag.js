// dag.json as this runtime reads it: the checks that keep a run from failing halfway (the schema
// version, an artifact for every CU, files inside dag.json's folder). The Python side validates
// the whole JSON Schema when it writes the file. A `cortex.dag/2` dag.json (shape
// specializations, cortex/specializations.py) holds one cortex.dag/1 body per input shape; each
// is checked as a dag.json of its own, and they must agree on the interface and differ in shapes.
import { CortexError } from "./errors.js";
import { fileUrl } from "./loader.js";
import { variantWasmRecords } from "./variants.js";

export const DAG_SCHEMA = "cortex.dag/1";
export const SPECIALIZED_DAG_SCHEMA = "cortex.dag/2";

/** @typedef {{name: string, offset: number, bytes: number, dtype: string, shape: number[],
 *             bound?: {axis: number, length_offset: number}}} PlanEntry */
/** @typedef {{memory_bytes: number, inputs: PlanEntry[], outputs: PlanEntry[]}} MemoryPlan */
/** @typedef {{features: string[], path: string, sha256: string, bytes: number, memory?: MemoryPlan,
 *             weights?: import("./weights.js").WeightEntry[]}} AlternateModule the CU built for other features
 *             (compile-wasm --features A;B); memory and weights where they differ from the primary's */
/** @typedef {{path: string, sha256: string, bytes: number, options: {features: string[]}, memory: MemoryPlan,
 *             weights?: import("./weights.js").WeightEntry[], alternates?: AlternateModule[]}} WasmRecord */
/** @typedef {{id: string, path: string, sha256: string, inputs: string[], outputs: string[], op_types?: string[],
 *             artifacts?: {wasm?: WasmRecord}, runs_on?: string, activation?: {tensor: string, equals: boolean},
 *             random?: boolean, cache?: string, flops?: number, variants?: Record<string, {artifacts?: {wasm?: WasmRecord}, trust?: number|null}>,
 *             calibration?: {outputs?: Record<string, {min?: number, max?: number, nonfinite?: boolean}>}}} CU */
/** @typedef {{name: string, dtype: string, shape: number[]}} TensorSpec */
/** @typedef {{schema: string, source_model?: {path: string, sha256: string},
 *             options?: {frozen_inputs?: {name: string}[]}, inputs: TensorSpec[], outputs: TensorSpec[], cus: CU[], order: string[],
 *             tensors: Record<string, {dtype: string, shape: number[], bytes: number, producer: string|null}>,
 *             selects?: {tensor: string, condition: string, cases: {equals: boolean, tensor: string}[]}[]}} Dag */

/** @typedef {{name: string, input_shapes: Record<string, number[]>, dims: Record<string, number>,
 *             input_values: Record<string, number | boolean>, dag: Dag}} Section */

const FALLBACK_RUNTIMES = ["onnxruntime"];

/** The sections of a dag.json: one for cortex.dag/1 (named null), one per specialization for
 * cortex.dag/2. Throws one error naming the file and what is wrong. @param {any} dag @param {URL} url
 * @returns {Section[]} */
export function checkedSections(dag, url) {
  const where = url.href;
  if (typeof dag !== "object" || dag === null || Array.isArray(dag)) throw new CortexError(`${where}: not a dag.json`);
  if (dag.schema !== SPECIALIZED_DAG_SCHEMA) {
    const one = checkDag(dag, url, where);
    return [{ name: /** @type {any} */ (null), input_shapes: shapesOf(one), dims: {}, input_values: {}, dag: one }];
  }
  if (!Array.isArray(dag.specializations) || !dag.specializations.length) {
    throw new CortexError(`${where}: 'specializations' is missing or empty`);
  }
  /** @type {Section[]} */
  const sections = [];
  /** @type {Map<string, string>} */
  const seen = new Map();
  for (const section of dag.specializations) {
    const { name, input_shapes: shapes, dims, input_values: values = {}, ...body } = section ?? {};
    const label = `${where} (specialization ${name})`;
    if (typeof name !== "string" || typeof shapes !== "object" || shapes === null || typeof dims !== "object") {
      throw new CortexError(`${where}: each specialization needs a name, input_shapes and dims`);
    }
    const one = checkDag({ schema: DAG_SCHEMA, model: dag.model, ...body }, url, label);
    const first = sections[0];
    if (first && interfaceOf(one) !== interfaceOf(first.dag)) {
      throw new CortexError(`${where}: specialization ${name} has other inputs or outputs than ${first.name}`);
    }
    // Value specializations (cortex/value_specializations.py) share their shapes and differ in input_values.
    const key = JSON.stringify([Object.keys(shapes).sort().map((k) => [k, shapes[k]]),
      Object.keys(values).sort().map((k) => [k, values[k]])]);
    if (seen.has(key)) {
      throw new CortexError(`${where}: specializations ${seen.get(key)} and ${name} have the same input shapes`
        + (Object.keys(values).length ? " and values" : ""));
    }
    seen.set(key, name);
    sections.push({ name, input_shapes: shapes, dims, input_values: values, dag: one });
  }
  return sections;
}

/** @param {Dag} dag */
const shapesOf = (dag) => Object.fromEntries(dag.inputs.map((s) => [s.name, s.shape]));

/** @param {Dag} dag */
const interfaceOf = (dag) => JSON.stringify([dag.inputs.map((s) => [s.name, s.dtype]), dag.outputs.map((s) => [s.name, s.dtype])]);

/** Throws one error naming the file and what is wrong. @param {any} dag @param {URL} url @param {string} where
 * @returns {Dag} */
export function checkDag(dag, url, where = url.href) {
  if (dag.schema !== DAG_SCHEMA) {
    throw new CortexError(`${where}: schema ${JSON.stringify(dag.schema)} is not ${DAG_SCHEMA} or ${SPECIALIZED_DAG_SCHEMA} `
      + "(rebuild it with cortex build-dag)");
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
      throw new CortexError(`${where}: ${cu.id} has no wasm artifact; run 'cortex compile-wasm --dag ${url.href}' first`);
    }
    for (const r of [record, ...variantWasmRecords(cu)].flatMap((m) => [m, ...(m.alternates ?? [])])) {
      fileUrl(url, r.path, cu.id);
      for (const w of r.weights ?? []) fileUrl(url, w.path, cu.id);
    }
  }
  return dag;
}

/** The wasm records of a dag's CUs and their variants (their features are checked against the engine).
 * @param {Dag} dag */
export function wasmRecords(dag) {
  return dag.cus.filter((cu) => cu.runs_on === undefined)
    .flatMap((cu) => [/** @type {WasmRecord} */ (cu.artifacts?.wasm), ...variantWasmRecords(cu)]);
}
