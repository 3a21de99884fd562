// CUs whose modules cut their large contractions into parts (`--wasm-features threads`,
// backends/wasm/kernel_parts.py): the module imports `env.memory`, a shared memory of exactly
// `memory.threads.pages` pages, and its `run` forks each split kernel's parts through a control
// block at `memory.threads.control`. With one thread the caller runs every part itself; the
// session's `threads` option N gives each such CU N - 1 workers of its own (js/src/kernel_worker.js:
// a Web Worker, or a worker_threads Worker in Node), each an instance of the same module on the
// same memory, parked in its `work` export between jobs. The caller blocks in `memory.atomic.wait32`
// until a job's parts are done, which a browser page's main thread may not: there, N > 1 is refused
// at create (run the session in a Worker). A shared memory exists only where SharedArrayBuffer
// does: in a browser, a crossOriginIsolated page.
// Workers start when the CU is instantiated and are stopped by `session.release()` (the module's
// `stop` export), started again by the next request. A worker's trap fails the request in one line
// naming the CU and the thread, and the CU gets a fresh memory, instance and workers before the
// next request runs, as in Python (backends/wasm/device.py).
import { CortexError } from "./errors.js";
import { mayBlock, sharedMemoryAvailable } from "./features.js";
import { WasmUnit, trapped } from "./wasm_unit.js";
import { IN_NODE, startWorker, workerClass } from "./workers.js";

const WORKER_URL = new URL("./kernel_worker.js", import.meta.url);
// Byte offsets of the control block's words the host touches (backends/wasm/kernel_parts.py).
const STOP = 24, FAULT = 32;
const CONTROL_BYTES = 64;
const REPORT_BYTES = 1024;          // why a worker trapped: two words, then the reason's UTF-8
const STOP_TIMEOUT_MS = 5000;       // a worker ends its part, then returns from `work`

/** The `threads` session option, checked. @param {unknown} value */
export function checkedThreads(value) {
  if (!Number.isInteger(value) || /** @type {number} */ (value) < 1) {
    throw new CortexError(`threads must be a whole number, at least 1 (got ${JSON.stringify(value)})`);
  }
  return /** @type {number} */ (value);
}

/** Whether a CU's (or variant's) module splits contractions into parts. @param {import("./dag.js").WasmRecord} record */
export const splitsKernels = (record) => record?.memory?.threads !== undefined;

/** The threads of one session's split CUs. */
export class KernelThreads {
  /** @param {number} count threads per split CU, the calling one included */
  constructor(count) {
    this.count = count;
    /** @type {Set<ThreadedUnit>} */
    this.units = new Set();
    /** @type {WeakMap<object, string[]>} a dag -> its split CUs, for the trace */
    this.split = new WeakMap();
  }

  /** Refuses, in one line, CUs this context cannot run. @param {[string, import("./dag.js").WasmRecord][]} records
   * (CU id, record) of every CU and variant @param {string} where dag.json's URL */
  check(records, where) {
    const found = records.find(([, record]) => splitsKernels(record));
    if (found === undefined) return;
    const [id] = found;
    if (!sharedMemoryAvailable()) {
      throw new CortexError(`${where}: ${id} was built with --wasm-features threads, whose shared memory needs `
        + "SharedArrayBuffer, which a browser gives only a crossOriginIsolated page (serve it with "
        + "Cross-Origin-Opener-Policy: same-origin and Cross-Origin-Embedder-Policy: require-corp), or rebuild "
        + "without the threads feature");
    }
    if (this.count > 1 && !mayBlock()) {
      throw new CortexError(`${where}: threads ${this.count}: ${id}'s caller waits for its kernel threads, which a `
        + "browser page's main thread may not: create the session in a Worker, or use threads 1");
    }
  }

  /** A split CU's unit: its shared memory with its weights, its instance and its workers.
   * @param {import("./dag.js").CU} cu @param {WebAssembly.Module} module
   * @param {(imports: WebAssembly.Imports) => Promise<WebAssembly.Instance>} instantiate
   * @param {import("./weights.js").WeightFiles} weights */
  async load(cu, module, instantiate, weights) {
    const { pages } = /** @type {any} */ (cu.artifacts?.wasm).memory.threads;
    const fresh = async () => {
      const memory = new WebAssembly.Memory({ initial: pages, maximum: pages, shared: true });
      const instance = await instantiate({ env: { memory } });
      await weights.write(cu, memory);
      return instance;
    };
    const unit = new ThreadedUnit(cu, await fresh(), module, fresh, this.count);
    await unit.ready();
    this.units.add(unit);
    return unit;
  }

  /** Null, or a promise that settles once every split CU has its workers (after `release`, or a
   * fresh instance after a failed request); it rejects when one cannot. */
  restarting() {
    /** @type {Promise<void>[]} */
    const waits = [];
    for (const unit of this.units) if (!unit.running()) waits.push(unit.ready());
    return waits.length ? Promise.all(waits).then(() => undefined) : null;
  }

  /** Stops every split CU's workers. */
  async close() {
    await Promise.all([...this.units].map((unit) => unit.close()));
  }

  /** The trace's `threads` for a request on `dag` (as Python's `threads_trace`).
   * @param {import("./dag.js").Dag} dag */
  trace(dag) {
    let split = this.split.get(dag);
    if (split === undefined) {
      split = dag.cus.filter((cu) => splitsKernels(/** @type {any} */ (cu.artifacts?.wasm))).map((cu) => cu.id);
      this.split.set(dag, split);
    }
    return { walk: "sequential", cu_threads: 1, kernel_threads: this.count, split_cus: split };
  }
}

/** A split CU: a WasmUnit on a shared memory of a fixed size, with `count - 1` workers. */
export class ThreadedUnit extends WasmUnit {
  /** @param {import("./dag.js").CU} cu @param {WebAssembly.Instance} instance @param {WebAssembly.Module} module
   * @param {() => Promise<WebAssembly.Instance>} fresh a new memory, instance and weights @param {number} count */
  constructor(cu, instance, module, fresh, count) {
    super(cu, instance);
    this.module = module;
    this.fresh = fresh;
    this.count = count;
    /** @type {any} */ this.exports = instance.exports;
    /** @type {KernelWorker[]} */ this.workers = [];
    this.report = new SharedArrayBuffer(REPORT_BYTES);
    /** Whether the instance failed a request and must be replaced before the next. */
    this.broken = false;
    /** @type {Promise<void> | null} a restart or rebuild under way */
    this.pending = null;
    this.bind(this.memory.buffer);
  }

  /** The memory never grows (its minimum is its maximum), and an engine may answer each read of a
   * shared memory's `buffer` with a new SharedArrayBuffer object: the one bound stays valid. */
  liveBuffer() {
    return /** @type {ArrayBuffer} */ (this.buffer);
  }

  /** The words of the module's control block. */
  get control() {
    return new Int32Array(/** @type {ArrayBuffer} */ (this.buffer), this.plan.threads.control, CONTROL_BYTES / 4);
  }

  /** Whether the unit can run a request now. */
  running() {
    return this.pending === null && !this.broken && this.workers.length === this.count - 1;
  }

  /** Settles once the unit can run: its workers started, its instance replaced if it failed. */
  ready() {
    if (this.pending === null) {
      if (this.broken) this.pending = this.rebuild();
      else if (this.workers.length < this.count - 1) this.pending = this.startWorkers();
      else return Promise.resolve();
    }
    const pending = this.pending;
    return pending.finally(() => { if (this.pending === pending) this.pending = null; });
  }

  /** The error of a request whose `run` trapped: a worker's trap (the reason it reported) or the
   * caller's own; the unit is replaced before the next request. @param {any} error */
  failure(error) {
    const words = new Int32Array(this.report, 0, 2);
    const tid = Atomics.load(words, 0);
    const reason = tid > 0 ? new TextDecoder().decode(new Uint8Array(this.report, 8, Atomics.load(words, 1)).slice()) : "";
    this.broken = true;
    this.ready().catch(() => undefined);        // the next request waits for it, and tells its failure
    if (tid <= 0) return trapped(this.cu, error);
    return new CortexError(`${this.cu.id} (${(this.cu.op_types ?? []).join(", ")}) failed: kernel thread ${tid} `
      + `trapped: ${reason}`);
  }

  /** Makes a worker trap after it runs part `part` of a job (null: none): the tests' way to fail a
   * thread in the middle of a kernel. @param {number | null} part */
  injectFault(part) {
    Atomics.store(this.control, FAULT / 4, part === null ? 0 : part + 1);
  }

  async rebuild() {
    await this.stopWorkers();
    const instance = await this.fresh();
    this.exports = instance.exports;
    this.memory = this.exports.memory;
    this.call = this.exports.run;
    this.bind(this.memory.buffer);
    this.broken = false;
    await this.startWorkers();
  }

  async startWorkers() {
    if (this.count < 2) return;
    this.report = new SharedArrayBuffer(REPORT_BYTES);
    const WorkerClass = await workerClass();
    const job = { module: this.module, memory: this.memory, report: this.report };
    const started = [];
    for (let tid = 1; tid < this.count; tid++) started.push(new KernelWorker(WorkerClass, { ...job, tid }, this.cu.id));
    this.workers = started;
    const outcomes = await Promise.allSettled(started.map((w) => w.ready));
    const failed = outcomes.find((o) => o.status === "rejected");
    if (failed !== undefined) {
      await this.stopWorkers();
      throw /** @type {PromiseRejectedResult} */ (failed).reason;
    }
  }

  /** Stops the workers: `stop`, then each one's return from `work` (bounded), then terminate. */
  async stopWorkers() {
    if (!this.workers.length) return;
    const workers = this.workers;
    this.workers = [];
    this.exports.stop();
    await Promise.all(workers.map((w) => w.end()));
    Atomics.store(this.control, STOP / 4, 0);        // workers started later on this memory must work
  }

  async close() {
    if (this.pending !== null) await this.pending.catch(() => undefined);
    await this.stopWorkers();
  }
}

/** One worker thread of a CU: `ready` settles once it has its instance (rejects with one line when
 * it cannot), `stopped` once it returned from `work` or ended. */
class KernelWorker {
  /** @param {any} WorkerClass @param {{module: WebAssembly.Module, memory: WebAssembly.Memory, report: SharedArrayBuffer,
   *  tid: number}} job @param {string} cuId */
  constructor(WorkerClass, job, cuId) {
    /** @type {(value?: any) => void} */ let started = () => undefined;
    /** @type {(error: any) => void} */ let refused = () => undefined;
    /** @type {(value?: any) => void} */ let ended = () => undefined;
    this.ready = new Promise((resolve, reject) => { [started, refused] = [resolve, reject]; });
    this.stopped = new Promise((resolve) => { ended = resolve; });
    const failed = (/** @type {string} */ why) => {
      refused(new CortexError(`${cuId}: kernel thread ${job.tid} did not start: ${why}`));
      ended();
    };
    const onMessage = (/** @type {any} */ message) => {
      if (message?.ready) {
        started();
        if (IN_NODE) this.worker.unref();       // parked: an unreleased session does not keep Node running
      }
      else if (message?.error !== undefined) failed(message.error);
      else if (message?.stopped) ended();
    };
    // A classic Web Worker: kernel_worker.js has no imports.
    this.worker = startWorker(WorkerClass, WORKER_URL, { name: `${cuId}-kernel-${job.tid}`, module: false, onMessage,
      onError: failed, onExit: () => failed("it exited") });
    this.worker.postMessage(job);
  }

  /** Ends the worker once it returned from `work` (the caller's instance called `stop`), or after
   * STOP_TIMEOUT_MS if it does not. */
  async end() {
    /** @type {any} */
    let timer;
    if (IN_NODE) this.worker.ref();             // until it answers
    await Promise.race([this.stopped, new Promise((resolve) => { timer = setTimeout(resolve, STOP_TIMEOUT_MS); })]);
    clearTimeout(timer);
    await this.worker.terminate();
  }
}
