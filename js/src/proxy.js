// `create` option `proxy: true`: the session lives in a dedicated Worker of its own (a module Web
// Worker; a worker_threads Worker in Node, js/src/proxy_worker.js), as onnxruntime-web's
// `env.wasm.proxy` does, and `release()` ends that Worker.
// Why: a released session's CU memories and modules are collected in the realm that held them, but
// the engine keeps that realm's compiled-code and allocator pools for reuse: in Chromium a page got
// back all but ~10 % of a model's weights (tests/test_js_memory_browser.py). A Worker's realm and
// what its thread holds go when the Worker ends, so a page gets all of it back. A page's main thread
// also stays free while CUs run.
// What crosses: requests and their feeds (copied: the caller keeps its tensors), outputs (copied),
// each request's trace, create's progress events and `generate`'s callbacks (each called on the
// calling thread, the Worker waiting for it, so a throwing callback stops the work as it does
// without a proxy). A session released this way stays usable, as any: the next request starts a
// Worker again and creates the session in it (from the module cache between visits in a browser).
import { CortexError } from "./errors.js";
import { Tensor } from "./tensor.js";
import { IN_NODE, startWorker, workerClass } from "./workers.js";

const WORKER_URL = new URL("./proxy_worker.js", import.meta.url);
/** Options that are functions: called here when the Worker asks. */
const CALLBACK_OPTIONS = ["onProgress"];
const GENERATE_CALLBACKS = ["onToken", "onLogits"];

/** The create option, checked. @param {unknown} option */
export function checkedProxy(option) {
  if (option !== undefined && typeof option !== "boolean") {
    throw new CortexError(`proxy must be true or false (got ${JSON.stringify(option) ?? typeof option})`);
  }
  return option === true;
}

/** An error from the Worker as the caller's: a CortexError stays one. @param {{error: string, cortex: boolean}} m */
const thrown = (m) => (m.cortex ? new CortexError(m.error) : new Error(m.error));

/** A Tensor from what crossed. @param {{type: string, data: any, dims: number[]}} t */
const tensorOf = (t) => new Tensor(/** @type {any} */ (t.type), t.data, t.dims);

export class ProxySession {
  /** Use `InferenceSession.create(where, {proxy: true})`. @param {URL} url @param {Record<string, any>} options */
  constructor(url, options) {
    this.url = url;
    const { proxy: _proxy, ...rest } = options;
    this.options = rest;
    /** @type {any} the Worker, while one runs */
    this.worker = null;
    /** @type {Promise<void> | null} the Worker started and its session created */
    this.started = null;
    /** @type {Map<number, {resolve: (v: any) => void, reject: (e: any) => void, callbacks: Record<string, Function>, failed?: unknown}>} */
    this.pending = new Map();
    this.nextId = 0;
    this.names = { inputNames: /** @type {string[]} */ ([]), outputNames: /** @type {string[]} */ ([]),
      inputMetadata: /** @type {any[]} */ ([]), outputMetadata: /** @type {any[]} */ ([]) };
    /** @type {any} */
    this.trace = null;
    /** @type {any} */
    this.lastGeneration = null;
    this.resident = 0;
    /** @type {Promise<unknown>} requests and release, in order */
    this.queue = Promise.resolve();
  }

  /** @param {URL} url dag.json's absolute URL (the Worker's own location is not the page's)
   * @param {Record<string, any>} options create's, `proxy` among them */
  static async create(url, options) {
    if (options.onnxruntime !== undefined) {
      throw new CortexError("proxy: the session runs in a Worker, which imports onnxruntime-web by name itself; "
        + "leave the onnxruntime option unset (or give proxy: false)");
    }
    const session = new ProxySession(url, options);
    await session.start();
    return session;
  }

  /** Starts a Worker and creates the session in it; a failure ends the Worker. */
  start() {
    if (this.started === null) {
      this.started = (async () => {
        await this.spawn();
        const { onProgress } = this.options;
        const options = Object.fromEntries(Object.entries(this.options).filter(([k]) => !CALLBACK_OPTIONS.includes(k)));
        try {
          this.names = await this.ask({ create: { url: this.url.href, options, progress: typeof onProgress === "function" } },
            onProgress === undefined ? {} : { onProgress });
        } catch (e) {
          this.end();
          throw e;
        }
      })();
      this.started.catch(() => { this.started = null; });
    }
    return this.started;
  }

  async spawn() {
    const stopped = (/** @type {string} */ why) => {
      if (this.worker !== worker) return;
      this.worker = null;
      this.started = null;
      for (const { reject } of this.pending.values()) reject(new CortexError(`${this.url.href}: the session's Worker ${why}`));
      this.pending.clear();
    };
    const worker = startWorker(await workerClass(), WORKER_URL, { name: "cortex-session", onMessage: (m) => this.message(m),
      onError: (why) => stopped(`stopped: ${why}`), onExit: (code) => stopped(`exited (code ${code})`) });
    this.worker = worker;
    this.idle();
  }

  /** Node: an idle Worker does not keep the process alive. */
  idle() {
    if (IN_NODE && this.worker !== null) {
      if (this.pending.size === 0) this.worker.unref(); else this.worker.ref();
    }
  }

  /** One request to the Worker, its reply's payload. @param {Record<string, any>} request
   * @param {Record<string, Function>} callbacks the functions the Worker may call meanwhile */
  ask(request, callbacks = {}) {
    const worker = this.worker;
    if (worker === null) return Promise.reject(new CortexError(`${this.url.href}: the session's Worker has ended`));
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject, callbacks });
      this.idle();
      try {
        worker.postMessage({ id, ...request });
      } catch (e) {
        this.pending.delete(id);
        this.idle();
        reject(new CortexError(`${this.url.href}: the request cannot be sent to the session's Worker: `
          + `${/** @type {any} */ (e).message ?? e}`));
      }
    });
  }

  /** @param {any} m */
  message(m) {
    const job = this.pending.get(m.id);
    if (job === undefined) return;
    if (m.call !== undefined) {
      this.call(job, m);
      return;
    }
    this.pending.delete(m.id);
    this.idle();
    if (m.error !== undefined) job.reject(thrown(m)); else job.resolve(m.reply);
  }

  /** A callback option the Worker calls. Progress events are told as they come (the Worker goes
   * on); what onProgress throws rejects create in one line and ends the Worker. The Worker waits for
   * `generate`'s callbacks: what one throws ends the generation with it, as without a proxy.
   * @param {{reject: (e: any) => void, callbacks: Record<string, Function>, failed?: unknown}} job @param {any} m */
  async call(job, m) {
    if (m.call === "onProgress") {
      try {
        job.callbacks.onProgress(m.args[0]);
      } catch (e) {
        this.pending.delete(m.id);
        job.reject(new CortexError(`onProgress threw: ${/** @type {any} */ (e)?.message ?? e}`));
        this.end();
      }
      return;
    }
    if (m.call === "onLogits") {
      // Called as generate calls it, without waiting; what it throws stops the generation at the
      // token's onToken, which the Worker waits for.
      try {
        job.callbacks.onLogits(new Float32Array(m.args[0]), m.args[1]);
      } catch (e) {
        job.failed ??= e;
      }
      return;
    }
    const reply = { id: m.id, returned: m.call };
    try {
      if (job.failed !== undefined) throw job.failed;
      await job.callbacks.onToken?.(...m.args);
      this.worker?.postMessage(reply);
    } catch (e) {
      this.worker?.postMessage({ ...reply, threw: String(/** @type {any} */ (e)?.message ?? e) });
    }
  }

  /** Ends the Worker (its realm and memory with it). */
  end() {
    const worker = this.worker;
    this.worker = null;
    this.started = null;
    for (const { reject } of this.pending.values()) reject(new CortexError(`${this.url.href}: the session was released`));
    this.pending.clear();
    return worker?.terminate();
  }

  get inputNames() { return this.names.inputNames; }

  get outputNames() { return this.names.outputNames; }

  get inputMetadata() { return this.names.inputMetadata.map((s) => ({ ...s })); }

  get outputMetadata() { return this.names.outputMetadata.map((s) => ({ ...s })); }

  /** The last request's trace (docs/runtime.md), as the Worker built it. */
  get lastTrace() { return this.trace; }

  /** What the loaded CUs' memories held after the last request. */
  get residentBytes() { return this.resident; }

  /** As `InferenceSession.run`. @param {any} feeds @param {any} [fetches] @param {any} [options] */
  run(feeds, fetches, options) {
    if (typeof feeds !== "object" || feeds === null || Array.isArray(feeds) || feeds instanceof Tensor) {
      return Promise.reject(new CortexError("feeds must be an object of input name -> Tensor"));
    }
    // Tensors cross as plain {type, data, dims}: an onnxruntime-web Tensor's data is a getter, which
    // a structured clone leaves behind.
    const plain = Object.fromEntries(Object.entries(feeds).map(([name, t]) => [name,
      t && typeof t === "object" && typeof t.type === "string" && t.data && t.dims ? { type: t.type, data: t.data, dims: [...t.dims] } : t]));
    return this.queued(async () => {
      const reply = await this.ask({ run: { feeds: plain, fetches, options } });
      [this.trace, this.resident] = [reply.trace, reply.residentBytes];
      return Object.fromEntries(Object.entries(reply.outputs).map(([name, t]) => [name, tensorOf(/** @type {any} */ (t))]));
    });
  }

  /** As `InferenceSession.generate`: onToken and onLogits are called here, in order, the Worker
   * waiting for each. @param {ArrayLike<number>} ids @param {Record<string, any>} [options] */
  generate(ids, options = {}) {
    const callbacks = Object.fromEntries(GENERATE_CALLBACKS.filter((k) => typeof options[k] === "function").map((k) => [k, options[k]]));
    const plain = Object.fromEntries(Object.entries(options).filter(([k]) => !GENERATE_CALLBACKS.includes(k)));
    return this.queued(async () => {
      const reply = await this.ask({ generate: { ids: Array.from(ids), options: plain, callbacks: Object.keys(callbacks) } }, callbacks);
      [this.trace, this.lastGeneration, this.resident] = [reply.trace, reply.lastGeneration, reply.residentBytes];
      return reply.result;
    });
  }

  /** @template T @param {() => Promise<T>} work after the requests already queued, a Worker started */
  queued(work) {
    const done = this.queue.then(async () => {
      await this.start();
      return work();
    });
    this.queue = done.catch(() => undefined);
    return done;
  }

  /** Ends the Worker after the requests already queued: everything the session held goes with its
   * realm. The session stays usable (the next request starts a Worker again). */
  release() {
    const done = this.queue.then(() => this.end());
    this.queue = done.catch(() => undefined);
    return done.then(() => undefined);
  }
}
