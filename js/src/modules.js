// Loading the CUs' modules: each file is read, its sha256 checked against dag.json (a tampered or
// stale file is refused), compiled and instantiated. All CUs load at once; over http the bytes
// stream into `WebAssembly.compileStreaming` while a clone of the response is hashed. A module
// file several CUs name (content-addressed builds: the same code in several specializations) is
// read and compiled once; each CU still gets an instance, and so a memory, of its own. A module
// that splits its contractions into parts imports its memory, a shared one (js/src/kernel_threads.js).
import { CortexError } from "./errors.js";
import { splitsKernels } from "./kernel_threads.js";
import { fetched, fileUrl, readBytes } from "./loader.js";
import { sha256Hex } from "./sha256.js";
import { WasmUnit } from "./wasm_unit.js";

export class ModuleFiles {
  /** @param {URL} base dag.json's URL */
  constructor(base) {
    this.base = base;
    /** @type {Map<string, Promise<[string, WebAssembly.Module]>>} path -> its sha256 and compiled module */
    this.modules = new Map();
  }

  /** The CU's compiled module, its sha256 checked. @param {import("./dag.js").CU} cu */
  async module(cu) {
    const record = /** @type {import("./dag.js").WasmRecord} */ (cu.artifacts?.wasm);
    const url = fileUrl(this.base, record.path, cu.id);
    let found = this.modules.get(record.path);
    if (found === undefined) {
      found = compiled(url, cu.id);
      this.modules.set(record.path, found);
    }
    const [bytesSha, module] = await found;
    if (bytesSha !== record.sha256) {
      throw new CortexError(`${url.href}: sha256 ${bytesSha} is not the ${record.sha256} that dag.json records for `
        + `${cu.id} (a stale or tampered file: recompile with cortex compile-wasm)`);
    }
    return module;
  }
}

/** @param {import("./dag.js").CU} cu @param {URL} base dag.json's URL @param {ModuleFiles} modules
 *  @param {import("./weights.js").WeightFiles} weights @param {import("./kernel_threads.js").KernelThreads} threads
 *  the session's threads, for a module that splits contractions into parts @returns {Promise<WasmUnit>} */
export async function loadWasmUnit(cu, base, modules, weights, threads) {
  const record = /** @type {import("./dag.js").WasmRecord} */ (cu.artifacts?.wasm);
  const url = fileUrl(base, record.path, cu.id);
  const module = await modules.module(cu);
  const instantiate = async (/** @type {WebAssembly.Imports} */ imports) => {
    try {
      return await WebAssembly.instantiate(module, imports);
    } catch (e) {
      throw new CortexError(`${url.href}: ${cu.id} cannot be instantiated: ${/** @type {any} */ (e).message ?? e}`);
    }
  };
  if (splitsKernels(record)) return threads.load(cu, module, instantiate, weights);
  const unit = new WasmUnit(cu, await instantiate({}));
  await weights.write(cu, unit.memory);
  return unit;
}

/** The module's sha256 and the compiled module. @param {URL} url @param {string} id
 * @returns {Promise<[string, WebAssembly.Module]>} */
async function compiled(url, id) {
  try {
    if (url.protocol !== "file:" && typeof WebAssembly.compileStreaming === "function") {
      const response = await fetched(url);
      const hashed = response.clone().arrayBuffer().then(sha256Hex);
      const module = await WebAssembly.compileStreaming(response).catch(async (e) => {
        // A server that does not send application/wasm: compile from the bytes instead.
        if (!(e instanceof TypeError)) throw e;
        return WebAssembly.compile(await (await fetched(url)).arrayBuffer());
      });
      return [await hashed, module];
    }
    const bytes = await readBytes(url);
    return [await sha256Hex(bytes), await WebAssembly.compile(bytes)];
  } catch (e) {
    if (e instanceof CortexError) throw e;
    throw new CortexError(`${url.href}: ${id} does not compile: ${/** @type {any} */ (e).message ?? e}`);
  }
}
