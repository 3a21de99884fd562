// Loading the CUs' modules: each file is read, its sha256 checked against dag.json (a tampered or
// stale file is refused), compiled and instantiated. All CUs load at once; over http the bytes
// stream into `WebAssembly.compileStreaming` while a clone of the response is hashed, and a
// module compiled before, in this process or on an earlier visit, comes from the module cache
// (js/src/module_cache.js). A module
// file several CUs name (content-addressed builds: the same code in several specializations) is
// read and compiled once; each CU still gets an instance, and so a memory, of its own. A module
// that splits its contractions into parts imports its memory, a shared one (js/src/kernel_threads.js).
// A CU built for several feature sets loads the module of the first set this engine has.
import { CortexError } from "./errors.js";
import { runnableRecord } from "./features.js";
import { splitsKernels } from "./kernel_threads.js";
import { fileUrl } from "./loader.js";
import { compiledModule } from "./module_cache.js";
import { WasmUnit } from "./wasm_unit.js";

export class ModuleFiles {
  /** @param {URL} base dag.json's URL @param {import("./module_cache.js").Loads} [loads] the module cache
   *  and create's progress (js/src/module_cache.js, js/src/progress.js) */
  constructor(base, loads = { cache: null, progress: null }) {
    this.base = base;
    this.loads = loads;
    /** @type {Map<string, Promise<[string, WebAssembly.Module | null]>>} path -> its sha256 and compiled module */
    this.modules = new Map();
  }

  /** The CU's compiled module, its sha256 checked: of the primary record or of the alternate this
   * engine runs (`engineRecord`). @param {import("./dag.js").CU} cu */
  async module(cu) {
    const record = engineRecord(cu);
    const url = fileUrl(this.base, record.path, cu.id);
    let found = this.modules.get(record.path);
    if (found === undefined) {
      found = compiledModule(url, record, cu.id, this.loads);
      this.modules.set(record.path, found);
    }
    const [bytesSha, module] = await found;
    if (bytesSha !== record.sha256) {
      throw new CortexError(`${url.href}: sha256 ${bytesSha} is not the ${record.sha256} that dag.json records for `
        + `${cu.id} (a stale or tampered file: recompile with cortex compile-wasm)`);
    }
    return /** @type {WebAssembly.Module} */ (module);
  }
}

/** @param {import("./dag.js").CU} cu @param {URL} base dag.json's URL @param {ModuleFiles} modules
 *  @param {import("./weights.js").WeightFiles} weights @param {import("./kernel_threads.js").KernelThreads} threads
 *  the session's threads, for a module that splits contractions into parts @returns {Promise<WasmUnit>} */
export async function loadWasmUnit(cu, base, modules, weights, threads) {
  const record = engineRecord(cu);
  // The unit, its weights and its threads see the module that runs: its plan, weight files and features.
  cu = { ...cu, artifacts: { ...cu.artifacts, wasm: record } };
  const url = fileUrl(base, record.path, cu.id);
  const module = await modules.module(cu);
  const instantiate = async (/** @type {WebAssembly.Imports} */ imports) => {
    try {
      return await WebAssembly.instantiate(module, imports);
    } catch (e) {
      const message = String(/** @type {any} */ (e).message ?? e);
      // Each CU's memory reserves its own address space, and an engine bounds how many a page or
      // process holds at once (Chromium 156: about 124), so a model of more CUs needs some dropped.
      const bound = /Cannot allocate Wasm memory/i.test(message) ? " (the engine holds no more wasm memories at once: "
        + "give the session memoryBudgetMB, which keeps only the CUs it fits instantiated, or build fewer, larger CUs "
        + "with decompose --max-cu-size)" : "";
      throw new CortexError(`${url.href}: ${cu.id} cannot be instantiated: ${message}${bound}`);
    }
  };
  if (splitsKernels(record)) return threads.load(cu, module, instantiate, weights);
  const unit = new WasmUnit(cu, await instantiate({}));
  await weights.write(cu, unit.memory);
  return unit;
}

/** The record of the CU's module this engine runs (js/src/features.js: the primary, else the first
 * alternate whose features it has); the primary when none fits, which the session's feature check
 * refused before anything loads. @param {import("./dag.js").CU} cu */
function engineRecord(cu) {
  const record = /** @type {import("./dag.js").WasmRecord} */ (cu.artifacts?.wasm);
  return runnableRecord(record) ?? record;
}
