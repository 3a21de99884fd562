// One CU worker of a session with `numThreads` > 1 where kernel threads cannot run (a page that is
// not crossOriginIsolated, a build without --wasm-features threads): js/src/cu_workers.js starts it
// as a module Web Worker, or a worker_threads Worker in Node. It owns a fixed subset of the CUs,
// each an instance with a memory of its own: it receives their compiled modules by postMessage
// (a WebAssembly.Module may cross to a worker without isolation), reads and checks their weight
// files itself (so a worker restarted after `release()` or a failure needs nothing the session has
// dropped), and runs a CU when asked, its inputs and outputs moving as transferred ArrayBuffers.
// Nothing here makes a SharedArrayBuffer: that is what lets it run on a page that is not isolated.
// A request's outputs that only this worker's CUs read stay here ("keep"), as the views of their
// CU's memory (each CU runs once in a request): a later job names them {kept: true}. A job of
// another request drops them.
// Messages in:  {base}, {load: [{key, cu, module}]},
//               {run, key, request, inputs: {name: {type, dims, buffer} | {kept: true}}, send: [name], keep: [name]},
//               {fault: key, kind: "trap" | "exit"} (the tests' way to fail a CU here).
// Messages out: {loaded: [[key, residentBytes]]} | {loadError}, {ran, outputs, startMs, seconds} | {failed, error}.
import { KernelThreads } from "./kernel_threads.js";
import { loadWasmUnit } from "./modules.js";
import { ARRAY_TYPES, Tensor } from "./tensor.js";
import { trapped } from "./wasm_unit.js";
import { WeightFiles } from "./weights.js";
import { parentChannel } from "./workers.js";

const channel = await parentChannel();
/** @type {URL | null} */
let base = null;
/** @type {WeightFiles | null} */
let weights = null;
// One thread per split CU: its caller (this worker) takes every part itself.
const kernelThreads = new KernelThreads(1);
/** @type {Map<string, import("./wasm_unit.js").WasmUnit>} */
const units = new Map();
/** @type {Map<string, Tensor>} the request's outputs kept here */
const kept = new Map();
/** @type {number | undefined} the request they belong to */
let keptFor;
/** @type {Map<string, string>} key -> the fault to raise on its next run */
const faults = new Map();

/** @param {{key: string, cu: any, module: WebAssembly.Module}[]} entries */
async function load(entries) {
  const loaded = [];
  for (const { key, cu, module } of entries) {
    const modules = { module: async () => module };
    const unit = await loadWasmUnit(cu, /** @type {URL} */ (base), /** @type {any} */ (modules),
      /** @type {WeightFiles} */ (weights), kernelThreads);
    units.set(key, unit);
    loaded.push([key, unit.residentBytes]);
  }
  return loaded;
}

/** Runs one CU; the outputs it is to send leave as copies of its memory's slots, transferred, and
 * those it is to keep stay as views. @param {any} job */
function run(job) {
  const unit = units.get(job.key);
  if (unit === undefined) throw new Error(`${job.key} is not loaded in this worker`);
  const fault = faults.get(job.key);
  if (fault !== undefined) {
    faults.delete(job.key);
    if (fault === "exit") channel.exit();
    throw trapped(unit.cu, new Error("an injected fault"));
  }
  if (job.request !== keptFor) {
    kept.clear();
    keptFor = job.request;
  }
  /** @type {Record<string, Tensor>} */
  const inputs = {};
  for (const name in job.inputs) {
    const { type, dims, buffer, kept: here } = job.inputs[name];
    if (here) {
      const tensor = kept.get(name);
      if (tensor === undefined) throw new Error(`${unit.cu.id}: its input ${name} is not kept in this worker`);
      inputs[name] = tensor;
    } else {
      inputs[name] = new Tensor(type, new ARRAY_TYPES[type](buffer), dims);
    }
  }
  const startMs = performance.timeOrigin + performance.now();
  const results = unit.run(inputs);
  const seconds = (performance.timeOrigin + performance.now() - startMs) / 1000;
  /** @type {Record<string, any>} */
  const outputs = {};
  const transfer = [];
  for (const name of job.keep) if (name in results) kept.set(name, results[name]);
  for (const name of job.send) {
    if (!(name in results)) continue;
    const { type, data, dims } = results[name];
    const buffer = data.slice().buffer;
    outputs[name] = { type, dims: [...dims], buffer };
    transfer.push(buffer);
  }
  return { message: { ran: job.run, outputs, startMs, seconds }, transfer };
}

channel.listen(async (/** @type {any} */ message) => {
  if (message.base !== undefined) {
    base = new URL(message.base);
    weights = new WeightFiles(base);
  } else if (message.load !== undefined) {
    try {
      channel.post({ loaded: await load(message.load) }, []);
    } catch (e) {
      channel.post({ loadError: String(/** @type {any} */ (e)?.message ?? e) }, []);
    }
  } else if (message.run !== undefined) {
    try {
      const { message: answer, transfer } = run(message);
      channel.post(answer, transfer);
    } catch (e) {
      channel.post({ failed: message.run, error: String(/** @type {any} */ (e)?.message ?? e) }, []);
    }
  } else if (message.fault !== undefined) {
    faults.set(message.fault, message.kind);
  }
});
channel.post({ started: true }, []);
