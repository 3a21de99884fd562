// `InferenceSession`, with onnxruntime-web's API: `await InferenceSession.create(urlOrPath, options)`,
// `await session.run(feeds, fetches?)` -> {name: Tensor}, `inputNames`, `outputNames`.
// Requests run one after another: each CU's memory holds one request's tensors at a time.
import { DEFAULT_CACHE_BYTES, ResultCache } from "./cache.js";
import { checkDag, wasmRecords } from "./dag.js";
import { CortexError } from "./errors.js";
import { loadFallbackUnit, onnxruntimeWeb } from "./fallback.js";
import { checkFeatures, recordedFeatures } from "./features.js";
import { checkedFeeds, requestedOutputs } from "./feeds.js";
import { dagUrl, readJson } from "./loader.js";
import { loadWasmUnit } from "./modules.js";
import { policy as resolvePolicy } from "./policy.js";
import { Scheduler } from "./scheduler.js";
import { emptyTrace, requestTrace } from "./trace.js";

/**
 * @typedef {object} SessionOptions
 * @property {string} [policy] strict, balanced (the default) or aggressive
 * @property {number} [cacheBytes] the result cache's budget; 0 turns it off
 * @property {any} [onnxruntime] onnxruntime-web, for fallback CUs (imported by name when absent)
 */

export class InferenceSession {
  /** Use `InferenceSession.create`. @param {URL} url @param {import("./dag.js").Dag} dag @param {Scheduler} scheduler @param {import("./policy.js").Policy} policy */
  constructor(url, dag, scheduler, policy) {
    this.url = url;
    this.dag = dag;
    this.scheduler = scheduler;
    this.policy = policy;
    this.cache = scheduler.cache;
    /** The last request's trace (docs/runtime.md). */
    this.lastTrace = emptyTrace(url.href);
    /** @type {Promise<unknown>} */
    this.queue = Promise.resolve();
  }

  /** @param {string | URL} where dag.json's URL or path @param {SessionOptions} [options] */
  static async create(where, options = {}) {
    const chosen = resolvePolicy(options.policy);
    const cacheBytes = options.cacheBytes ?? DEFAULT_CACHE_BYTES;
    if (!Number.isInteger(cacheBytes) || cacheBytes < 0) {
      throw new CortexError(`the cache budget must be a whole number of bytes, at least 0 (got ${cacheBytes})`);
    }
    const url = await dagUrl(where);
    const dag = checkDag(await readJson(url), url);
    checkFeatures(recordedFeatures(wasmRecords(dag)), url.href);
    const fallback = dag.cus.filter((cu) => cu.runs_on !== undefined);
    const ort = fallback.length ? await onnxruntimeWeb(options.onnxruntime) : null;
    const units = await Promise.all(dag.cus.map((cu) => (cu.runs_on === undefined ? loadWasmUnit(cu, url)
      : loadFallbackUnit(cu, url, ort))));
    const scheduler = new Scheduler(dag, new Map(units.map((unit) => [unit.cu.id, unit])), new ResultCache(cacheBytes));
    return new InferenceSession(url, dag, scheduler, chosen);
  }

  get inputNames() {
    return this.dag.inputs.map((s) => s.name);
  }

  get outputNames() {
    return this.dag.outputs.map((s) => s.name);
  }

  /** Names, dtypes and shapes, as dag.json records them. */
  get inputMetadata() {
    return this.dag.inputs.map((s) => ({ ...s }));
  }

  get outputMetadata() {
    return this.dag.outputs.map((s) => ({ ...s }));
  }

  /**
   * The requested outputs (all by default). `fetches`: output names, or an object keyed by them, as
   * in onnxruntime-web; `options.policy` overrides the session's policy for this request.
   * @param {Record<string, import("./tensor.js").Tensor>} feeds
   * @param {string[] | Record<string, unknown> | {policy?: string}} [fetches]
   * @param {{policy?: string}} [options]
   * @returns {Promise<Record<string, import("./tensor.js").Tensor>>}
   */
  run(feeds, fetches, options) {
    if (fetches && !Array.isArray(fetches) && typeof fetches === "object"
        && !Object.keys(fetches).some((name) => this.outputNames.includes(name)) && options === undefined) {
      [fetches, options] = [undefined, /** @type {{policy?: string}} */ (fetches)];   // run(feeds, options)
    }
    const done = this.queue.then(() => this.runNow(feeds, fetches, options ?? {}));
    this.queue = done.catch(() => undefined);
    return done;
  }

  /** @param {any} feeds @param {any} fetches @param {{policy?: string}} options */
  async runNow(feeds, fetches, options) {
    const chosen = options.policy === undefined ? this.policy : resolvePolicy(options.policy);
    const names = requestedOutputs(fetches, this.dag.outputs);
    const checked = checkedFeeds(feeds, this.dag.inputs);
    const { results, request } = await this.scheduler.run(checked, chosen, names);
    this.lastTrace = requestTrace({ policy: chosen.name, dag: this.url.href, outputs: names, request,
      residentBytes: this.scheduler.residentBytes(), cacheStats: chosen.cache ? this.cache.stats() : null });
    return results;
  }

  async release() {
    this.cache.clear();
  }
}
