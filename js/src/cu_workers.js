// Threads without SharedArrayBuffer: the session option `numThreads` N on a page that is not
// crossOriginIsolated (or for a build whose modules do not split kernels) runs independent CUs at
// the same time on N - 1 Workers (js/src/cu_worker.js; worker_threads in Node, module Web Workers
// in browsers) and the calling thread. Each CU has one owner thread, fixed when its section is
// instantiated by a list schedule over dag.json (below); a worker holds instances (and memories)
// of its CUs only, and tensors cross as copies in transferred ArrayBuffers, which needs no isolation.
// Where the modules split kernels and the thread may block on a shared memory, `numThreads` gives
// the kernel threads instead (js/src/kernel_threads.js), as the `threads` option does.
// A request whose policy needs no decision between CUs (no selects, no activation condition it
// honours, no CU it may look up in the cache, no reduced-precision variant it picks, all CUs on
// wasm) walks the dag as a dataflow: a CU starts as soon as its inputs are there. Any other request
// takes the scheduler's sequential walk, a worker's CU answering with a promise, with every
// semantics of js/src/scheduler.js; the trace's `threads.walk` says which ran, and why not threaded.
// A worker's failure (a trap, or the worker ending) fails the request in one line naming the CU;
// the worker is ended, and started again with fresh instances of its CUs by the next request that
// needs it, as after `release()`.
import { copied } from "./cache.js";
import { CortexError } from "./errors.js";
import { mayBlock, sharedMemoryAvailable } from "./features.js";
import { checkedThreads, splitsKernels } from "./kernel_threads.js";
import { REPEATING } from "./plan.js";
import { NOT_NEEDED } from "./scheduler.js";
import { ARRAY_TYPES, Tensor } from "./tensor.js";
import { clock } from "./trace.js";

const IN_NODE = typeof process !== "undefined" && !!process.versions?.node;
const WORKER_URL = new URL("./cu_worker.js", import.meta.url);

// The list schedule's cost model, in nanoseconds: rough single-thread WebAssembly SIMD rates, and
// what a tensor crossing threads costs (a copy out, a postMessage, a copy in). Only their ratios
// matter: they keep a chain on one thread and put independent branches on different ones.
const NS_PER_FLOP = 0.1;
const NS_PER_BYTE = 0.2;
const NS_PER_CU = 2_000;
const NS_PER_CROSSING = 30_000;
const NS_PER_CROSSED_BYTE = 0.5;

/** @typedef {"single" | "cu-workers" | "kernel-threads"} ThreadMode */

/** The `numThreads` session option, checked. @param {unknown} value */
export function checkedNumThreads(value) {
  if (!Number.isInteger(value) || /** @type {number} */ (value) < 1) {
    throw new CortexError(`numThreads must be a whole number, at least 1 (got ${JSON.stringify(value)})`);
  }
  return /** @type {number} */ (value);
}

/** How `numThreads` runs on this build here: kernel threads where the modules split kernels and
 * this thread may wait on a shared memory, CU workers otherwise (for more than one thread). Shared
 * memory is probed only for a build that splits kernels: a page that is not isolated never makes a
 * SharedArrayBuffer. @param {number} numThreads @param {import("./dag.js").WasmRecord[]} records
 * @returns {ThreadMode} */
export function threadMode(numThreads, records) {
  if (records.some(splitsKernels) && sharedMemoryAvailable() && mayBlock()) return "kernel-threads";
  return numThreads > 1 ? "cu-workers" : "single";
}

/** The session's threads: `numThreads` as `threadMode` says; `threads` (kernel threads only) as before.
 * @param {{threads?: number, numThreads?: number, memoryBudgetMB?: number}} options
 * @param {import("./dag.js").WasmRecord[]} records @param {string} where dag.json's URL
 * @returns {{mode: ThreadMode, threads: number}} */
export function sessionThreads(options, records, where) {
  if (options.threads !== undefined) {
    if (options.numThreads !== undefined) throw new CortexError("give numThreads or threads, not both");
    const threads = checkedThreads(options.threads);
    return { mode: threads > 1 && records.some(splitsKernels) ? "kernel-threads" : "single", threads };
  }
  const threads = checkedNumThreads(options.numThreads ?? 1);
  const mode = threads === 1 ? "single" : threadMode(threads, records);
  if (mode === "cu-workers" && options.memoryBudgetMB !== undefined) {
    throw new CortexError(`${where}: numThreads ${threads} runs CUs on workers, which keep their CUs resident: `
      + "memoryBudgetMB needs numThreads 1 here");
  }
  return { mode, threads };
}

/** Each CU's owner thread (0: the calling one): a list schedule in dag.json's order, each CU on
 * the thread where it would end first, counting the crossings of its inputs from other threads.
 * Fallback CUs stay on the calling thread, which holds onnxruntime-web.
 * @param {import("./dag.js").Dag} dag @param {number} threads @returns {Map<string, number>} */
export function assignThreads(dag, threads) {
  const cus = new Map(dag.cus.map((cu) => [cu.id, cu]));
  const owner = new Map(), finish = new Map();
  const free = new Array(threads).fill(0);
  for (const id of dag.order) {
    const cu = /** @type {import("./dag.js").CU} */ (cus.get(id));
    const bytes = [...cu.inputs, ...cu.outputs].reduce((n, name) => n + (dag.tensors[name]?.bytes ?? 0), 0);
    const cost = NS_PER_CU + (cu.flops ?? 0) * NS_PER_FLOP + bytes * NS_PER_BYTE;
    let best = 0, bestEnd = Infinity;
    for (let t = 0; t < (cu.runs_on === undefined ? threads : 1); t++) {
      let ready = 0;
      for (const name of cu.inputs) {
        const producer = dag.tensors[name]?.producer;
        if (producer == null || !finish.has(producer)) continue;
        const crossing = owner.get(producer) === t ? 0 : NS_PER_CROSSING + dag.tensors[name].bytes * NS_PER_CROSSED_BYTE;
        ready = Math.max(ready, finish.get(producer) + crossing);
      }
      const end = Math.max(ready, free[t]) + cost;
      if (end < bestEnd) [best, bestEnd] = [t, end];
    }
    owner.set(id, best);
    finish.set(id, bestEnd);
    free[best] = bestEnd;
  }
  return owner;
}

/** Why a request cannot walk the dag as a dataflow (null: it can): a decision between CUs.
 * @param {import("./scheduler.js").Scheduler} scheduler @param {import("./policy.js").Policy} policy */
export function sequentialReason(scheduler, policy) {
  const { dag } = scheduler;
  if (dag.selects?.length) return "selects (a decomposed If) pick a case once its condition is known";
  if (scheduler.mixed) return "CUs run on another device";
  if (policy.skipInactive && dag.cus.some((cu) => cu.activation)) return "the policy skips inactive branches";
  if (policy.cache && scheduler.cache.enabled && dag.cus.some((cu) => cu.cache === REPEATING)) {
    return "the policy looks CUs up in the result cache";
  }
  if (policy.trustThreshold !== null && dag.cus.some((cu) => scheduler.variants.choice(cu.id, policy) !== null)) {
    return "the policy runs reduced-precision variants";
  }
  return null;
}

/** A CU a worker owns, as the scheduler sees it: `run` answers with a promise. */
class RemoteUnit {
  /** @param {CuWorkers} workers @param {string} key @param {import("./dag.js").CU} cu @param {number} thread
   *  @param {number} residentBytes */
  constructor(workers, key, cu, thread, residentBytes) {
    this.workers = workers;
    this.key = key;
    this.cu = cu;
    this.thread = thread;
    this.residentBytes = residentBytes;
  }

  /** @param {Record<string, Tensor>} inputs */
  async run(inputs) {
    return (await this.workers.run(this, inputs)).outputs;
  }
}

/** The workers of one session and the CUs each owns. */
export class CuWorkers {
  /** @param {number} threads the calling one included @param {URL} base dag.json's URL */
  constructor(threads, base) {
    this.threads = threads;
    this.base = base;
    /** @type {(WorkerHandle | null)[]} index t - 1 for thread t */
    this.handles = new Array(threads - 1).fill(null);
    /** @type {(Promise<WorkerHandle> | null)[]} a worker started with every CU it owns */
    this.ready = new Array(threads - 1).fill(null);
    /** @type {(WorkerHandle | null)[]} each worker once it holds every CU it owns: posted to at once */
    this.current = new Array(threads - 1).fill(null);
    /** @type {Map<string, {thread: number, cu: import("./dag.js").CU, module: WebAssembly.Module, dag: object}>} */
    this.owned = new Map();
    /** @type {WeakMap<object, Map<string, number>>} dag -> each CU's thread */
    this.owners = new WeakMap();
    this.loads = 0;
  }

  /** The units of a section's CUs: the calling thread's loaded by `loadHere`, the others in their
   * workers, to which their compiled modules are posted.
   * @param {import("./dag.js").Dag} dag @param {(cu: import("./dag.js").CU) => Promise<WebAssembly.Module>} moduleOf
   * @param {(cu: import("./dag.js").CU) => Promise<any>} loadHere @returns {Promise<any[]>} in dag.cus' order */
  async units(dag, moduleOf, loadHere) {
    const owner = assignThreads(dag, this.threads);
    this.owners.set(dag, owner);
    const keys = new Map();
    for (const [key, o] of this.owned) if (o.dag === dag) this.owned.delete(key);   // instantiated again
    await Promise.all(dag.cus.filter((cu) => owner.get(cu.id) !== 0).map(async (cu) => {
      const key = `${this.loads++}:${cu.id}`;
      this.owned.set(key, { thread: /** @type {number} */ (owner.get(cu.id)), cu, module: await moduleOf(cu), dag });
      keys.set(cu.id, key);
    }));
    const threads = new Set([...keys.keys()].map((id) => /** @type {number} */ (owner.get(id))));
    const loaded = await Promise.all([...threads].map((t) => this.refreshed(t)));
    const resident = new Map(loaded.flatMap((handle) => [...handle.loaded]));
    return Promise.all(dag.cus.map((cu) => {
      const key = keys.get(cu.id);
      if (key === undefined) return loadHere(cu);
      return new RemoteUnit(this, key, cu, /** @type {number} */ (owner.get(cu.id)), resident.get(key) ?? 0);
    }));
  }

  /** Thread t's worker, once it also holds the CUs it was given since it started. @param {number} t */
  refreshed(t) {
    const before = this.ready[t - 1];
    this.current[t - 1] = null;
    const now = (before ? before.catch(() => undefined) : Promise.resolve()).then(() => this.started(t));
    this.ready[t - 1] = now;
    now.catch(() => { if (this.ready[t - 1] === now) this.ready[t - 1] = null; });
    return now;
  }

  /** Thread t's worker, started (again) if it is not running, holding every CU it owns. @param {number} t */
  worker(t) {
    return this.ready[t - 1] ?? this.refreshed(t);
  }

  /** @param {number} t */
  async started(t) {
    let handle = this.handles[t - 1];
    if (handle === null || handle.ended) {
      handle = new WorkerHandle(t, this.base, () => { [this.ready[t - 1], this.current[t - 1]] = [null, null]; });
      this.handles[t - 1] = handle;
      await handle.started;
    }
    const missing = [...this.owned].filter(([key, o]) => o.thread === t && !handle.loaded.has(key))
      .map(([key, { cu, module }]) => ({ key, cu, module }));
    if (missing.length) await handle.load(missing);
    if (!handle.ended) this.current[t - 1] = handle;
    return handle;
  }

  /** Runs a worker's CU: copies of its inputs go over, its outputs come back.
   * @param {RemoteUnit} unit @param {Record<string, Tensor>} inputs */
  run(unit, inputs) {
    // Posted at once when the worker is there: the caller may run its own CUs next, without yielding.
    const handle = this.current[unit.thread - 1];
    if (handle !== null) return this.send(handle, unit, inputs);
    return this.worker(unit.thread).then((h) => this.send(h, unit, inputs));
  }

  /** @param {WorkerHandle} handle @param {RemoteUnit} unit @param {Record<string, Tensor>} inputs */
  async send(handle, unit, inputs) {
    /** @type {Record<string, any>} */
    const sent = {};
    const transfer = [];
    for (const name in inputs) {
      const { type, data, dims } = inputs[name];
      const buffer = data.slice().buffer;
      sent[name] = { type, dims: [...dims], buffer };
      transfer.push(buffer);
    }
    const answer = await handle.run(unit, sent, transfer);   // posts before its first await
    /** @type {Record<string, Tensor>} */
    const outputs = {};
    for (const name in answer.outputs) {
      const { type, dims, buffer } = answer.outputs[name];
      outputs[name] = new Tensor(type, new (/** @type {any} */ (ARRAY_TYPES)[type])(buffer), dims);
    }
    return { outputs, startMs: answer.startMs - performance.timeOrigin, seconds: answer.seconds };
  }

  /** A request walked as a dataflow: each CU starts once its inputs are there, the workers' CUs
   * posted before the calling thread runs its own. Same results and trace fields as `Scheduler.run`.
   * @param {import("./scheduler.js").Scheduler} scheduler @param {Record<string, Tensor>} feeds
   * @param {import("./policy.js").Policy} policy @param {string[]} outputs */
  async walk(scheduler, feeds, policy, outputs) {
    const plan = scheduler.plan(policy, outputs);
    const used = new Set(scheduler.steps.filter((step) => step.unit instanceof RemoteUnit).map((step) => step.unit.thread));
    await Promise.all([...used].filter((t) => this.current[t - 1] === null).map((t) => this.worker(t)));
    const env = new Map(Object.entries(feeds));
    let liveBytes = 0;
    for (const name in feeds) liveBytes += feeds[name].data.byteLength;
    /** @type {any} */
    const request = { policy, needed: plan.needed, env, home: new Map(), keys: new Map(), activated: [], skipped: [], liveBytes };
    /** @type {Map<string, number>} CU -> inputs it still waits for */
    const waiting = new Map();
    /** @type {any[]} */
    const ready = [];
    const stepOf = new Map(scheduler.steps.map((step) => [step.id, step]));
    for (const step of scheduler.steps) {
      if (plan.needed !== null && !plan.needed.has(step.id)) {
        request.skipped.push({ cu: step.id, reason: NOT_NEEDED });
        continue;
      }
      const missing = new Set(step.cu.inputs.filter((name) => !env.has(name))).size;
      if (missing === 0) ready.push(step); else waiting.set(step.id, missing);
    }
    let left = waiting.size + ready.length;
    /** @type {Error | null} */
    let failure = null;
    /** @type {() => void} */
    let wake = () => undefined;
    const done = (/** @type {any} */ step, /** @type {Record<string, any>} */ results, /** @type {number} */ start,
      /** @type {number} */ seconds) => {
      for (const name in results) {
        env.set(name, results[name]);
        for (const reader of new Set(scheduler.readers.get(name) ?? [])) {
          const count = waiting.get(reader);
          if (count === undefined) continue;
          if (count === 1) {
            waiting.delete(reader);
            ready.push(stepOf.get(reader));
          } else {
            waiting.set(reader, count - 1);
          }
        }
      }
      request.liveBytes += step.bytesOut;
      request.activated.push({ step, start, seconds, cpuSeconds: seconds, crossed: 0,
        residentBytes: step.unit.residentBytes, variant: {} });
      left -= 1;
    };
    const inputsOf = (/** @type {any} */ step) => Object.fromEntries(step.cu.inputs.map((name) => [name, env.get(name)]));
    while (left > 0) {
      if (failure !== null) throw failure;
      const remote = ready.filter((step) => step.unit instanceof RemoteUnit);
      const here = ready.filter((step) => !(step.unit instanceof RemoteUnit));
      ready.length = 0;
      for (const step of remote) {
        this.run(step.unit, inputsOf(step)).then(({ outputs: results, startMs, seconds }) => {
          done(step, results, startMs, seconds);
          wake();
        }, (error) => {
          failure ??= error;
          wake();
        });
      }
      if (here.length) {
        const [step, ...later] = here;
        ready.push(...later);
        const start = clock();
        let results = step.unit.run(inputsOf(step));
        if (results instanceof Promise) results = await results;
        done(step, results, start, (clock() - start) / 1000);
        continue;
      }
      if (left > 0 && ready.length === 0 && failure === null) await new Promise((resolve) => { wake = () => resolve(undefined); });
    }
    if (failure !== null) throw failure;
    request.activated.sort((/** @type {any} */ a, /** @type {any} */ b) => a.start - b.start);
    /** @type {Record<string, Tensor>} */
    const results = {};
    for (const name of outputs) results[name] = copied(env.get(name));
    return { results, request };
  }

  /** The trace's `threads` for a request on `dag`. @param {import("./dag.js").Dag} dag
   * @param {string | null} sequential why the request walked sequentially (null: it did not) */
  trace(dag, sequential) {
    const owner = this.owners.get(dag) ?? new Map();
    return { walk: sequential === null ? "threaded" : "sequential", cu_threads: this.threads, kernel_threads: 1,
      split_cus: dag.cus.filter((cu) => splitsKernels(/** @type {any} */ (cu.artifacts?.wasm))).map((cu) => cu.id),
      mode: "cu-workers", threads: this.threads, cu_thread: Object.fromEntries(owner),
      ...(sequential === null ? {} : { sequential_because: sequential }) };
  }

  /** Makes a worker fail the next run of a CU it owns: its `kind` "trap" throws there, "exit" ends
   * the worker. The tests' way to fail a worker. @param {string} cuId @param {"trap" | "exit"} kind */
  async injectFault(cuId, kind) {
    const found = [...this.owned].reverse().find(([, o]) => o.cu.id === cuId);
    if (found === undefined) throw new CortexError(`${cuId} is not a worker's CU`);
    (await this.worker(found[1].thread)).post({ fault: found[0], kind });
  }

  /** Ends every worker; the next request that needs one starts it again. */
  async close() {
    const handles = this.handles.filter((h) => h !== null);
    this.handles.fill(null);
    this.ready.fill(null);
    this.current.fill(null);
    await Promise.all(handles.map((h) => /** @type {WorkerHandle} */ (h).end("was stopped by release()")));
  }
}

/** One worker: its jobs in flight, the CUs it holds (key -> resident bytes). */
class WorkerHandle {
  /** @param {number} thread @param {URL} base @param {() => void} onEnd */
  constructor(thread, base, onEnd) {
    this.thread = thread;
    this.onEnd = onEnd;
    /** @type {Map<string, number>} */
    this.loaded = new Map();
    /** @type {Map<number, {resolve: (v: any) => void, reject: (e: any) => void, cu: import("./dag.js").CU}>} */
    this.jobs = new Map();
    this.nextJob = 0;
    /** @type {{resolve: (v: any) => void, reject: (e: any) => void} | null} */
    this.loading = null;
    this.ended = false;
    /** @type {(v?: any) => void} */ let started = () => undefined;
    /** @type {(e: any) => void} */ let refused = () => undefined;
    this.started = new Promise((resolve, reject) => { [started, refused] = [resolve, reject]; });
    this.started.catch(() => undefined);
    this.refused = refused;
    this.workerReady = (async () => {
      const WorkerClass = IN_NODE ? (await import("node:worker_threads")).Worker : globalThis.Worker;
      this.worker = IN_NODE ? new WorkerClass(WORKER_URL) : new WorkerClass(WORKER_URL, { type: "module", name: `cu-worker-${thread}` });
      const onMessage = (/** @type {any} */ m) => this.message(m, started, base);
      if (IN_NODE) {
        this.worker.on("message", onMessage);
        this.worker.on("error", (/** @type {any} */ e) => this.fail(`stopped: ${e?.message ?? e}`));
        this.worker.on("exit", (/** @type {number} */ code) => this.fail(`exited (code ${code})`));
      } else {
        this.worker.addEventListener("message", (/** @type {MessageEvent} */ e) => onMessage(e.data));
        this.worker.addEventListener("error", (/** @type {any} */ e) => this.fail(`stopped: ${e?.message ?? "it did not load"}`));
      }
    })();
    this.workerReady.catch((e) => this.fail(`did not start: ${e?.message ?? e}`));
  }

  /** @param {any} message @param {(v?: any) => void} started @param {URL} base */
  message(message, started, base) {
    if (message.started) {
      this.post({ base: base.href });
      this.idle();
      started();
    } else if (message.loaded !== undefined) {
      for (const [key, bytes] of message.loaded) this.loaded.set(key, bytes);
      this.loading?.resolve(undefined);
      this.loading = null;
    } else if (message.loadError !== undefined) {
      this.loading?.reject(new CortexError(message.loadError));
      this.loading = null;
    } else if (message.ran !== undefined) {
      const job = this.jobs.get(message.ran);
      this.jobs.delete(message.ran);
      this.idle();
      job?.resolve(message);
    } else if (message.failed !== undefined) {
      const job = this.jobs.get(message.failed);
      this.jobs.delete(message.failed);
      job?.reject(new CortexError(message.error));
      // The CU's instance may be left halfway: the worker ends, and starts with fresh ones.
      this.end(`ended after ${job?.cu.id ?? "a CU"} failed`);
    }
  }

  /** @param {any} message @param {Transferable[]} [transfer] */
  post(message, transfer = []) {
    this.worker.postMessage(message, transfer);
  }

  /** Node: a worker with nothing to do does not keep the process alive; one with jobs does. */
  idle() {
    if (!IN_NODE || this.ended) return;
    if (this.jobs.size === 0 && this.loading === null) this.worker.unref(); else this.worker.ref();
  }

  /** @param {{key: string, cu: import("./dag.js").CU, module: WebAssembly.Module}[]} entries */
  load(entries) {
    return new Promise((resolve, reject) => {
      this.loading = { resolve: (v) => { this.idle(); resolve(v); }, reject: (e) => { this.idle(); reject(e); } };
      this.idle();
      this.post({ load: entries });
    });
  }

  /** @param {RemoteUnit} unit @param {Record<string, any>} inputs @param {Transferable[]} transfer */
  run(unit, inputs, transfer) {
    if (this.ended) return Promise.reject(new CortexError(`${unit.cu.id}: CU worker ${this.thread} has ended`));
    const id = this.nextJob++;
    return new Promise((resolve, reject) => {
      this.jobs.set(id, { resolve, reject, cu: unit.cu });
      this.idle();
      this.post({ run: id, key: unit.key, inputs }, transfer);
    });
  }

  /** The worker failed or ended: every job in flight fails, naming its CU. @param {string} why */
  fail(why) {
    if (this.ended) return;
    this.ended = true;
    this.onEnd();
    for (const job of this.jobs.values()) {
      job.reject(new CortexError(`${job.cu.id} (${(job.cu.op_types ?? []).join(", ")}) failed: CU worker ${this.thread} ${why}`));
    }
    this.jobs.clear();
    this.loading?.reject(new CortexError(`CU worker ${this.thread} ${why} while loading its CUs`));
    this.loading = null;
    this.refused(new CortexError(`CU worker ${this.thread} ${why} before it started`));
  }

  /** Ends the worker; jobs in flight fail with `why`. @param {string} why */
  async end(why) {
    this.fail(why);
    await this.workerReady.catch(() => undefined);
    await this.worker?.terminate();
  }
}
