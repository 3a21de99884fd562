// `InferenceSession`, with onnxruntime-web's API: `await InferenceSession.create(urlOrPath, options)`,
// `await session.run(feeds, fetches?)` -> {name: Tensor}, `inputNames`, `outputNames`.
// Requests run one after another: each CU's memory holds one request's tensors at a time.
import { DEFAULT_CACHE_BYTES, ResultCache } from "./cache.js";
import { CuWorkers, sequentialReason, sessionThreads } from "./cu_workers.js";
import { checkedSections, wasmRecords } from "./dag.js";
import { CortexError } from "./errors.js";
import { loadFallbackUnit, onnxruntimeWeb } from "./fallback.js";
import { checkFeatures, recordedFeatures } from "./features.js";
import { checkedFeeds, requestedOutputs } from "./feeds.js";
import { generate } from "./generate.js";
import { KernelThreads, ThreadedUnit, checkedThreads } from "./kernel_threads.js";
import { dagUrl, readJson } from "./loader.js";
import { moduleCache } from "./module_cache.js";
import { ModuleFiles, loadWasmUnit } from "./modules.js";
import { SourceModel } from "./offline.js";
import { policy as resolvePolicy } from "./policy.js";
import { DEFAULT_PREFIX_CACHE_MB, PrefixCache, prefixCacheBytes } from "./prefix_cache.js";
import { counted, loadProgress } from "./progress.js";
import { ProxySession, checkedProxy } from "./proxy.js";
import { ResidentSet, Residency, budgetBytes, checkBudget } from "./residency.js";
import { Scheduler } from "./scheduler.js";
import { Buckets, compiledShapes, exactSection, feedShapes, sectionsForValues, shapesText, valueInputs } from "./specialized.js";
import { Tensor } from "./tensor.js";
import { variantRecord } from "./variants.js";
import { emptyTrace, offlineTrace, requestRecord, requestTrace } from "./trace.js";
import { WeightFiles } from "./weights.js";

/**
 * @typedef {object} SessionOptions
 * @property {string} [policy] strict, balanced (the default), aggressive or offline
 * @property {number|null} [trustThreshold] replaces the policy's trust threshold (null: exact CUs
 *   only), as `cortex run --trust-threshold`
 * @property {number} [cacheBytes] the result cache's budget; 0 turns it off
 * @property {any} [onnxruntime] onnxruntime-web, for fallback CUs and the offline policy (imported
 *   by name when absent)
 * @property {string} [padToBucket] shape specializations: pad a request no specialization matches
 *   up to the nearest larger one along this dim (or input), as `cortex run --pad-to-bucket`
 * @property {number} [padValue] the value padding writes (0 by default)
 * @property {number} [prefixCacheMB] the bound of `generate`'s prefix cache in MiB (256 by default;
 *   0 turns it off)
 * @property {number} [threads] threads per CU of a `--wasm-features threads` build, the calling one
 *   included (1 by default): each such CU gets `threads - 1` workers (js/src/kernel_threads.js)
 * @property {number} [numThreads] threads of the session, the calling one included (1 by default): the
 *   kernel threads where the modules split kernels and the thread may block on shared memory, else
 *   `numThreads - 1` CU workers running independent CUs at once, no SharedArrayBuffer needed (js/src/cu_workers.js)
 * @property {number} [memoryBudgetMB] the most the resident CUs' memories hold, in MiB, as `cortex run
 *   --memory-budget` (js/src/residency.js); absent: every CU of a section stays resident once loaded
 * @property {(event: import("./progress.js").ProgressEvent) => void} [onProgress] called during create
 *   as files are read and CUs loaded, up to the totals dag.json records (js/src/progress.js)
 * @property {boolean} [moduleCache] keep compiled modules for later sessions and visits (true by
 *   default; js/src/module_cache.js)
 * @property {boolean} [proxy] run the session in a dedicated Worker of its own, which `release()` ends,
 *   so the page gets back everything the session held (false by default; js/src/proxy.js)
 */

// Sections of a cortex.dag/2 dag.json: every module and weight file is fetched, checked and
// compiled at create (a tampered file is refused there, and compiling is most of a load), but a
// section's CUs are instantiated, each with a memory holding its weights, on the first request for
// its shape; the first section at create. A page pays memory only for the shapes it meets, and the
// first request at a new shape pays instantiation and a copy of the weights, not a fetch or a compile.
// Reduced-precision variants are fetched, checked and instantiated when a policy first picks them
// (the session's policy's picks with their section). Under the offline policy nothing of the CUs
// is read at create, as in Python: offline is what runs when they cannot be loaded; a later
// request under another policy loads them then.

/** @typedef {{policy?: string, trustThreshold?: number|null}} RunOptions */

export class InferenceSession {
  /** Use `InferenceSession.create`.
   * @param {URL} url @param {any} document dag.json as read @param {import("./dag.js").Section[]} sections
   * @param {any} ort onnxruntime-web as given @param {ResultCache} cache
   * @param {import("./policy.js").Policy} policy @param {Buckets | null} buckets @param {number} padValue
   * @param {PrefixCache} prefixCache @param {KernelThreads} kernelThreads
   * @param {import("./module_cache.js").Loads} [loads] the module cache and create's progress */
  constructor(url, document, sections, ort, cache, policy, buckets, padValue, prefixCache, kernelThreads,
    loads = { cache: null, progress: null }) {
    this.url = url;
    this.document = document;
    this.sections = sections;
    this.givenOrt = ort;
    this.loads = loads;
    this.files = { modules: new ModuleFiles(url, loads), weights: new WeightFiles(url, loads.progress, loads.cache),
      ort: /** @type {any} */ (null) };
    /** @type {Promise<void> | null} every module and weight file fetched, checked and compiled */
    this.cusRead = null;
    /** @type {Promise<void>} the checks before any file is read passed (readCus) */
    this.cusChecked = Promise.resolve();
    /** @type {Promise<SourceModel> | null} */
    this.source = null;
    this.cache = cache;
    this.policy = policy;
    this.buckets = buckets;
    this.padValue = padValue;
    /** @type {(Scheduler | undefined)[]} one per section, once it is instantiated */
    this.schedulers = sections.map(() => undefined);
    this.chosen = 0;
    /** The specialization the last request ran on (null for a single-shape dag.json). @type {string | null} */
    this.specialization = null;
    /** The last request's trace, once built. @type {any} */
    this.trace = emptyTrace(url.href);
    /** What the last request's trace is built from, until it is. @type {ReturnType<typeof requestRecord> | null} */
    this.traceRecord = null;
    /** @type {Promise<unknown>} */
    this.queue = Promise.resolve();
    /** How the last `generate` ran (js/src/generate.js). @type {any} */
    this.lastGeneration = null;
    /** Prompt chunks `generate` already ran, kept across its calls (js/src/prefix_cache.js). */
    this.prefixCache = prefixCache;
    /** The workers of the CUs that split contractions into parts. */
    this.kernelThreads = kernelThreads;
    /** Under `numThreads` without kernel threads, the CU workers (js/src/cu_workers.js). @type {CuWorkers | null} */
    this.cuWorkers = null;
    /** Which threads requests run on: single, kernel-threads or cu-workers. */
    this.threadMode = "single";
    /** Under `memoryBudgetMB`, the resident CUs of every section (js/src/residency.js). @type {ResidentSet | null} */
    this.residentSet = null;
  }

  /** @param {string | URL} where dag.json's URL or path @param {SessionOptions} [options] */
  static async create(where, options = {}) {
    if (checkedProxy(options.proxy)) return /** @type {any} */ (ProxySession.create(await dagUrl(where), options));
    const chosen = resolvePolicy(options.policy, options.trustThreshold);
    const cacheBytes = options.cacheBytes ?? DEFAULT_CACHE_BYTES;
    if (!Number.isInteger(cacheBytes) || cacheBytes < 0) {
      throw new CortexError(`the cache budget must be a whole number of bytes, at least 0 (got ${cacheBytes})`);
    }
    const padValue = options.padValue ?? 0;
    if (typeof padValue !== "number" || Number.isNaN(padValue)) {
      throw new CortexError(`padValue must be a number (got ${JSON.stringify(padValue)})`);
    }
    const prefixCache = new PrefixCache(prefixCacheBytes(options.prefixCacheMB ?? DEFAULT_PREFIX_CACHE_MB));
    const kernelThreads = new KernelThreads(checkedThreads(options.threads ?? 1));
    const loads = { cache: moduleCache(options.moduleCache), progress: loadProgress(options.onProgress) };
    const url = await dagUrl(where);
    const document = await readJson(url);
    const sections = checkedSections(document, url);
    const threading = sessionThreads(options, sections.flatMap((s) => wasmRecords(s.dag)), url.href);
    if (threading.mode === "kernel-threads") kernelThreads.count = threading.threads;
    const budget = budgetBytes(options.memoryBudgetMB);
    if (budget !== null) checkBudget(sections.flatMap((s) => s.dag.cus), budget, url.href);
    let buckets = null;
    if (options.padToBucket !== undefined) {
      if (sections[0].name === null) {
        throw new CortexError(`--pad-to-bucket ${options.padToBucket}: ${url.href} was built for one input shape; padding `
          + "needs shape specializations (decompose --dim NAME=A,B,...)");
      }
      buckets = new Buckets(sections, String(options.padToBucket));
    }
    const session = new InferenceSession(url, document, sections, options.onnxruntime, new ResultCache(cacheBytes),
      chosen, buckets, padValue, prefixCache, kernelThreads, loads);
    session.threadMode = threading.mode;
    if (threading.mode === "cu-workers") session.cuWorkers = new CuWorkers(threading.threads, url);
    if (budget !== null) {
      session.residentSet = new ResidentSet(budget);
      session.files.weights.keep = false;     // a weight file is read again whenever its CU loads
    }
    loads.progress?.plan(sections, chosen);
    try {
      if (chosen.offline) {
        await session.sourceModel();
      } else {
        await session.instantiated(0);
      }
      loads.progress?.finish();        // throws what onProgress threw, once every load has settled
    } catch (e) {
      loads.progress?.stop();
      if (loads.progress?.thrown !== undefined) await session.release();
      throw e;
    }
    return session;
  }

  /** The last request's trace (docs/runtime.md), built on first read. */
  get lastTrace() {
    if (this.traceRecord !== null) {
      this.trace = requestTrace(this.traceRecord);
      this.traceRecord = null;
    }
    return this.trace;
  }

  /** Every module and weight file of every section, fetched, checked and compiled once. Sooner,
   * `cusChecked` settles once the records' threads and features are checked (and onnxruntime-web
   * is there for fallback CUs) and every read has started. */
  readCus() {
    if (this.cusRead === null) {
      const cus = this.sections.flatMap((s) => s.dag.cus);
      this.cusChecked = (async () => {
        this.kernelThreads.check(cus.filter((cu) => cu.runs_on === undefined).flatMap((cu) => [cu,
          ...Object.keys(cu.variants ?? {}).map((p) => variantRecord(cu, p))]).map((r) => [r.id, /** @type {any} */ (r.artifacts?.wasm)]),
        this.url.href);
        checkFeatures(recordedFeatures(this.sections.flatMap((s) => wasmRecords(s.dag))), this.url.href);
        if (cus.some((cu) => cu.runs_on !== undefined)) this.files.ort = await onnxruntimeWeb(this.givenOrt);
      })();
      this.cusRead = this.cusChecked.then(async () => {
        const wasm = cus.filter((cu) => cu.runs_on === undefined);
        // Under a budget the weight files are read (and checked) when their CUs load, never all at once.
        const weights = this.residentSet === null ? this.files.weights.readAll(wasm) : undefined;
        await Promise.all([...wasm.map((cu) => this.files.modules.module(cu)), weights]);
      });
      this.cusRead.catch(() => { this.cusRead = null; });
    }
    return this.cusRead;
  }

  /** The offline policy's source model, read, checked and opened on first use. */
  sourceModel() {
    if (this.source === null) {
      this.source = onnxruntimeWeb(this.givenOrt, "the offline policy runs the source model on")
        .then((ort) => SourceModel.open(this.document, this.url, this.outputNames, ort));
      this.source.catch(() => { this.source = null; });
    }
    return this.source;
  }

  /** Section i's scheduler, its CUs instantiated on first use, with the variants the session's
   * policy picks. @param {number} i */
  async instantiated(i) {
    let scheduler = this.schedulers[i];
    if (scheduler === undefined) {
      const read = this.readCus();
      await this.cusChecked;
      const { dag } = this.sections[i];
      const { modules, weights, ort } = this.files;
      const { progress } = this.loads;
      const load = (/** @type {import("./dag.js").CU} */ record) => counted(progress,
        loadWasmUnit(record, this.url, modules, weights, this.kernelThreads));
      const residency = this.residentSet === null ? null
        : new Residency(this.residentSet, dag, load, (unit) => this.dropUnit(unit));
      const loadHere = (/** @type {import("./dag.js").CU} */ cu) => (cu.runs_on !== undefined
        ? counted(progress, loadFallbackUnit(cu, this.url, ort)) : residency?.units.get(cu.id) ?? load(cu));
      // The section's CUs are instantiated as their modules arrive, while the other files are still read.
      const [units] = await Promise.all([this.cuWorkers?.units(dag, (cu) => modules.module(cu), loadHere)
        ?? Promise.all(dag.cus.map(loadHere)), read]).finally(() => this.loads.cache?.writeHeld());
      scheduler = new Scheduler(dag, new Map(units.map((unit) => [unit.cu.id, unit])), this.cache, load);
      scheduler.residency = residency;
      await scheduler.variants.load(this.policy);
      this.schedulers[i] = scheduler;
      if (this.schedulers.every((s) => s !== undefined)) weights.release();
    }
    return scheduler;
  }

  /** The dag.json body of the section the last request ran on (the first before any request). */
  get dag() {
    return this.sections[this.chosen].dag;
  }

  /** The scheduler of that section. */
  get scheduler() {
    return /** @type {Scheduler} */ (this.schedulers[this.chosen]);
  }

  get inputNames() {
    return this.dag.inputs.map((s) => s.name);
  }

  get outputNames() {
    return this.dag.outputs.map((s) => s.name);
  }

  /** Names, dtypes and shapes, as dag.json records them. */
  get inputMetadata() {
    return [...this.dag.inputs, ...valueInputs(this.sections[this.chosen])].map((s) => ({ ...s }));
  }

  get outputMetadata() {
    return this.dag.outputs.map((s) => ({ ...s }));
  }

  /**
   * The requested outputs (all by default). `fetches`: output names, or an object keyed by them, as
   * in onnxruntime-web; `options.policy` (and `options.trustThreshold`) override the session's
   * policy for this request.
   * @param {Record<string, import("./tensor.js").Tensor>} feeds
   * @param {string[] | Record<string, unknown> | RunOptions} [fetches]
   * @param {RunOptions} [options]
   * @returns {Promise<Record<string, import("./tensor.js").Tensor>>}
   */
  run(feeds, fetches, options) {
    if (fetches && !Array.isArray(fetches) && typeof fetches === "object"
        && !Object.keys(fetches).some((name) => this.outputNames.includes(name)) && options === undefined) {
      [fetches, options] = [undefined, /** @type {RunOptions} */ (fetches)];   // run(feeds, options)
    }
    const done = this.queue.then(() => this.runNow(feeds, fetches, options ?? {}));
    this.queue = done.catch(() => undefined);
    return done;
  }

  /** @param {any} feeds @param {any} fetches @param {RunOptions} options */
  async runNow(feeds, fetches, options) {
    const chosen = options.policy === undefined && options.trustThreshold === undefined ? this.policy
      : resolvePolicy(options.policy ?? this.policy.name, options.trustThreshold);
    const names = requestedOutputs(fetches, this.dag.outputs);
    if (this.sections[0].name === null) return this.runOn(0, feeds, names, chosen);
    if (typeof feeds !== "object" || feeds === null || Array.isArray(feeds) || feeds instanceof Tensor) {
      checkedFeeds(feeds, this.dag.inputs);          // refuses it with the single-shape message
    }
    const shapes = feedShapes(feeds);
    const among = sectionsForValues(this.sections, feeds, this.url.href);
    // The section's build froze the inputs specialised by value: they leave its feeds here.
    const frozen = new Set(Object.keys(this.sections[0].input_values));
    feeds = Object.fromEntries(Object.entries(feeds).filter(([name]) => !frozen.has(name)));
    const exact = exactSection(this.sections, shapes, among);
    if (exact >= 0) return this.runOn(exact, feeds, names, chosen);
    if (this.buckets === null) {
      throw new CortexError(`no shape specialization matches the inputs (${shapesText(shapes)}); ${this.url.href} `
        + `was compiled for: ${compiledShapes(this.sections)}`);
    }
    const buckets = this.buckets;
    const [i, length] = buckets.nearest(shapes, this.url.href, among);
    const padded = Object.fromEntries(Object.entries(feeds).map(([name, t]) => [name, buckets.pad(name, t, i, this.padValue)]));
    const results = await this.runOn(i, padded, names, chosen);
    return Object.fromEntries(Object.entries(results).map(([name, t]) => [name, buckets.slice(name, t, length)]));
  }

  /** @param {number} i @param {any} feeds @param {string[]} names @param {import("./policy.js").Policy} chosen */
  async runOn(i, feeds, names, chosen) {
    const { dag, name } = this.sections[i];
    if (chosen.offline) {
      const checked = checkedFeeds(feeds, dag.inputs);
      const source = await this.sourceModel();
      [this.chosen, this.specialization] = [i, name];
      const { results, run } = await source.run(checked, names);
      [this.trace, this.traceRecord] = [offlineTrace({ dag: this.url.href, outputs: names, run }), null];
      return results;
    }
    const scheduler = await this.instantiated(i);
    const restarting = this.kernelThreads.restarting();     // after release(), or a kernel thread's failure
    if (restarting !== null) await restarting;
    const checked = checkedFeeds(feeds, dag.inputs);
    [this.chosen, this.specialization] = [i, name];
    const sequential = this.cuWorkers === null ? null : sequentialReason(scheduler, chosen);
    const { results, request } = this.cuWorkers !== null && sequential === null
      ? await this.cuWorkers.walk(scheduler, checked, chosen, names) : await scheduler.run(checked, chosen, names);
    this.traceRecord = requestRecord({ policy: chosen.name, dag: this.url.href, outputs: names, request,
      residentBytes: scheduler.residentBytes(), cacheStats: chosen.cache ? this.cache.stats() : null,
      threads: this.cuWorkers?.trace(dag, sequential)
        ?? { ...this.kernelThreads.trace(dag), mode: this.threadMode, threads: this.kernelThreads.count } });
    return results;
  }

  /** New token ids after `ids` on a language model compiled for generation (js/src/generate.js).
   * @param {ArrayLike<number>} ids @param {import("./generate.js").GenerateOptions} [options] */
  generate(ids, options) {
    return generate(this, ids, options);
  }

  /** What every loaded CU's memory holds now (variants included), every section's. */
  get residentBytes() {
    return this.schedulers.reduce((n, s) => n + (s?.residentBytes() ?? 0), 0);
  }

  /** Ends what a dropped unit runs besides its memory: a split CU's workers. @param {any} unit */
  async dropUnit(unit) {
    if (!(unit instanceof ThreadedUnit)) return;
    this.kernelThreads.units.delete(unit);
    await unit.close();
  }

  /** Drops every instance (every section's CUs and variants, their workers), the compiled modules,
   * the host copies of weight files and the caches, after the requests already queued: nothing of
   * the session keeps a CU's memory or module, so the engine can collect them (a module whose
   * weights are in its data segments keeps them in its bytes). The session stays usable: a later
   * request reads, checks and compiles the modules again (from the module cache where another
   * session still holds them, or from the Cache API in a browser), then instantiates its section's
   * CUs and writes their weights, as the first one did. */
  release() {
    const done = this.queue.then(async () => {
      void this.lastTrace;                    // the trace's numbers, not the units its record names
      this.cache.clear();
      this.prefixCache.clear();
      await this.kernelThreads.close();
      await this.cuWorkers?.close();
      this.kernelThreads.units.clear();
      for (const scheduler of this.schedulers) await scheduler?.residency?.clear();
      this.schedulers = this.sections.map(() => undefined);
      this.files.weights.release();
      this.files.modules = new ModuleFiles(this.url, this.loads);
      this.cusRead = null;
    });
    this.queue = done.catch(() => undefined);
    return done;
  }
}
