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
import { IN_NODE, startWorker, workerClass } from "./workers.js";

const WORKER_URL = new URL("./cu_worker.js", import.meta.url);

// The list schedule's cost model, in nanoseconds: rough single-thread WebAssembly SIMD rates, and
// what a tensor crossing threads costs (a copy out, a postMessage, a copy in). Only their ratios
// matter: they keep a chain on one thread and put independent branches on different ones.
const NS_PER_FLOP = 0.1;
const NS_PER_BYTE = 0.2;
const NS_PER_CU = 2_000;
const NS_PER_CROSSING = 30_000;
const NS_PER_CROSSED_BYTE = 0.5;
// Below this share of one thread's modelled time saved, a section's CUs all stay on the calling thread.
export const MIN_GAIN = 0.1;

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

/** A list schedule of the dag's CUs on `threads` threads, in dag.json's order, each CU on the
 * thread where it would end first, counting the crossings of its inputs from other threads, by the
 * cost model above. Fallback CUs stay on the calling thread, which holds onnxruntime-web.
 * @param {import("./dag.js").Dag} dag @param {number} threads
 * @returns {{owner: Map<string, number>, makespan: number}} each CU's thread (0: the calling one), and
 *   the modelled nanoseconds to the last CU's end */
export function listSchedule(dag, threads) {
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
  return { owner, makespan: Math.max(0, ...free) };
}

/** Each CU's owner thread (0: the calling one): the list schedule's, unless it would save under
 * MIN_GAIN of one thread's time (a chain of CUs, or branches too small for their crossings), where
 * every CU stays on the calling thread and no worker starts, as the Python runtime's
 * `gains_from_threads` keeps such a model on one thread: `numThreads` then costs nothing.
 * @param {import("./dag.js").Dag} dag @param {number} threads
 * @returns {{owner: Map<string, number>, oneThreadBecause: string | null}} */
export function assignThreads(dag, threads) {
  const alone = listSchedule(dag, 1).makespan;
  const spread = listSchedule(dag, threads);
  const saved = alone > 0 ? 1 - spread.makespan / alone : 0;
  if (saved >= MIN_GAIN) return { owner: spread.owner, oneThreadBecause: null };
  return { owner: new Map(dag.cus.map((cu) => [cu.id, 0])),
    oneThreadBecause: `its CUs on ${threads} threads would save ${Math.round(Math.max(saved, 0) * 100)}% of one thread's `
      + `time by the list schedule (under ${MIN_GAIN * 100}%: a chain, or branches too small for their crossings)` };
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

/** A tensor as it crosses to a worker: its buffer itself where `handOn` (a buffer of the walk's own,
 * read nowhere else) and it spans the buffer, else a copy of its bytes.
 * @param {Tensor} tensor @param {boolean} handOn @param {Transferable[]} transfer */
function crossing(tensor, handOn, transfer) {
  const { type, data, dims } = tensor;
  const whole = handOn && data.byteOffset === 0 && data.byteLength === data.buffer.byteLength;
  const buffer = whole ? data.buffer : data.slice().buffer;
  transfer.push(buffer);
  return [{ type, dims: [...dims], buffer }];
}

/** Resolves once the messages that came for this thread have been taken: a task, not a microtask,
 * since a worker's answer is a task of its own (Node: setImmediate runs after pending messages;
 * a browser: a MessageChannel's message queues behind them). */
function messagesTaken() {
  if (IN_NODE) return new Promise((resolve) => setImmediate(resolve));
  return new Promise((resolve) => {
    const channel = new MessageChannel();
    channel.port1.onmessage = () => { channel.port1.close(); resolve(undefined); };
    channel.port2.postMessage(null);
  });
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
    /** @type {WeakMap<object, string | null>} dag -> why its CUs all stay on the calling thread (null: they do not) */
    this.oneThread = new WeakMap();
    this.requests = 0;
    this.loads = 0;
  }

  /** The units of a section's CUs: the calling thread's loaded by `loadHere`, the others in their
   * workers, to which their compiled modules are posted.
   * @param {import("./dag.js").Dag} dag @param {(cu: import("./dag.js").CU) => Promise<WebAssembly.Module>} moduleOf
   * @param {(cu: import("./dag.js").CU) => Promise<any>} loadHere @returns {Promise<any[]>} in dag.cus' order */
  async units(dag, moduleOf, loadHere) {
    const { owner, oneThreadBecause } = assignThreads(dag, this.threads);
    this.owners.set(dag, owner);
    this.oneThread.set(dag, oneThreadBecause);
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

  /** Runs a worker's CU (the scheduler's sequential walk): copies of its inputs go over, its outputs come back.
   * @param {RemoteUnit} unit @param {Record<string, Tensor>} inputs */
  run(unit, inputs) {
    /** @type {Record<string, any>} */
    const sent = {};
    const transfer = [];
    for (const name in inputs) [sent[name]] = crossing(inputs[name], false, transfer);
    return this.post(unit, { inputs: sent, send: unit.cu.outputs, keep: [] }, transfer);
  }

  /** Posts a job to the worker of `unit`: at once when the worker is there (the caller may run its
   * own CUs next, without yielding), else once it has started.
   * @param {RemoteUnit} unit @param {{inputs: Record<string, any>, send: string[], keep: string[], request?: number}} job
   * @param {Transferable[]} transfer */
  post(unit, job, transfer) {
    const handle = this.current[unit.thread - 1];
    if (handle !== null) return this.answer(handle, unit, job, transfer);
    return this.worker(unit.thread).then((h) => this.answer(h, unit, job, transfer));
  }

  /** @param {WorkerHandle} handle @param {RemoteUnit} unit @param {any} job @param {Transferable[]} transfer */
  async answer(handle, unit, job, transfer) {
    const answer = await handle.run(unit, job, transfer);   // posts before its first await
    /** @type {Record<string, Tensor>} */
    const outputs = {};
    for (const name in answer.outputs) {
      const { type, dims, buffer } = answer.outputs[name];
      outputs[name] = new Tensor(type, new (/** @type {any} */ (ARRAY_TYPES)[type])(buffer), dims);
    }
    return { outputs, startMs: answer.startMs - performance.timeOrigin, seconds: answer.seconds };
  }

  /** A request walked as a dataflow: each CU starts once its inputs are there, the workers' CUs
   * posted before the calling thread runs its own, and between its own CUs the calling thread
   * takes the answers that came (a worker's next CU may wait on one). A worker's output that only
   * CUs of that worker read stays there (its CU's memory holds it until the request ends); one
   * that came from a worker goes on to another without a copy when no other CU here needs it.
   * A section whose CUs all stay on the calling thread takes the scheduler's walk, which is the
   * one of `numThreads` 1. Same results and trace fields as `Scheduler.run`.
   * @param {import("./scheduler.js").Scheduler} scheduler @param {Record<string, Tensor>} feeds
   * @param {import("./policy.js").Policy} policy @param {string[]} outputs */
  async walk(scheduler, feeds, policy, outputs) {
    const used = new Set(scheduler.steps.filter((step) => step.unit instanceof RemoteUnit).map((step) => step.unit.thread));
    if (used.size === 0) return scheduler.run(feeds, policy, outputs);
    const plan = scheduler.plan(policy, outputs);
    await Promise.all([...used].filter((t) => this.current[t - 1] === null).map((t) => this.worker(t)));
    const request = this.requests++;
    const env = new Map(Object.entries(feeds));
    let liveBytes = 0;
    for (const name in feeds) liveBytes += feeds[name].data.byteLength;
    /** @type {any} */
    const state = { policy, needed: plan.needed, env, home: new Map(), keys: new Map(), activated: [], skipped: [], liveBytes };
    /** @type {Map<string, number>} CU -> inputs it still waits for */
    const waiting = new Map();
    /** @type {any[]} */
    const ready = [];
    const stepOf = new Map(scheduler.steps.map((step) => [step.id, step]));
    const threadOf = (/** @type {any} */ step) => (step.unit instanceof RemoteUnit ? step.unit.thread : 0);
    /** @type {Map<string, number>} tensor -> the thread whose worker keeps it */
    const keptOn = new Map();
    /** @type {Map<string, number>} tensor -> its readers that have not started */
    const unread = new Map();
    /** @type {Set<string>} tensors whose buffers came from a worker: the walk may hand them on */
    const ours = new Set();
    const requested = new Set(outputs);
    for (const step of scheduler.steps) {
      if (plan.needed !== null && !plan.needed.has(step.id)) {
        state.skipped.push({ cu: step.id, reason: NOT_NEEDED });
        continue;
      }
      for (const name of new Set(step.cu.inputs)) unread.set(name, (unread.get(name) ?? 0) + 1);
      const missing = new Set(step.cu.inputs.filter((name) => !env.has(name))).size;
      if (missing === 0) ready.push(step); else waiting.set(step.id, missing);
    }
    /** Where a worker step's outputs go: back here (read on another thread, or asked for) and/or kept. */
    const destinations = (/** @type {any} */ step) => {
      const t = threadOf(step), send = [], keep = [];
      for (const name of step.cu.outputs) {
        const readers = [...(scheduler.readers.get(name) ?? [])].map((id) => stepOf.get(id))
          .filter((reader) => reader !== undefined && (plan.needed === null || plan.needed.has(reader.id)));
        if (requested.has(name) || readers.some((reader) => threadOf(reader) !== t)) send.push(name);
        if (readers.some((reader) => threadOf(reader) === t)) keep.push(name);
      }
      return { send, keep };
    };
    let left = waiting.size + ready.length;
    let inFlight = 0;
    /** @type {Error | null} */
    let failure = null;
    /** @type {() => void} */
    let wake = () => undefined;
    /** `${tensor}\0${reader}`: a worker's reader counted as having the tensor when the CU that
     * keeps it for the reader was posted (below), not again when that CU is done. */
    const early = new Set();
    const arrived = (/** @type {string} */ name) => {
      for (const reader of new Set(scheduler.readers.get(name) ?? [])) {
        if (early.delete(`${name}\0${reader}`)) continue;
        const count = waiting.get(reader);
        if (count === undefined) continue;
        if (count === 1) {
          waiting.delete(reader);
          ready.push(stepOf.get(reader));
        } else {
          waiting.set(reader, count - 1);
        }
      }
    };
    const done = (/** @type {any} */ step, /** @type {Record<string, any>} */ results, /** @type {string[]} */ kept,
      /** @type {number} */ start, /** @type {number} */ seconds) => {
      for (const name of kept) {
        keptOn.set(name, threadOf(step));
        if (!(name in results)) arrived(name);
      }
      for (const name in results) {
        env.set(name, results[name]);
        arrived(name);
      }
      state.liveBytes += step.bytesOut;
      state.activated.push({ step, start, seconds, cpuSeconds: seconds, crossed: 0,
        residentBytes: step.unit.residentBytes, variant: {} });
      left -= 1;
    };
    const read = (/** @type {string} */ name) => {
      const count = /** @type {number} */ (unread.get(name)) - 1;
      unread.set(name, count);
      return count === 0 && ours.has(name) && !requested.has(name);
    };
    const post = (/** @type {any} */ step) => {
      const t = threadOf(step);
      /** @type {Record<string, any>} */
      const inputs = {};
      const transfer = [];
      for (const name of new Set(step.cu.inputs)) {
        const last = read(name);
        if (keptOn.get(name) === t) {
          inputs[name] = { kept: true };
        } else {
          [inputs[name]] = crossing(/** @type {Tensor} */ (env.get(name)), last, transfer);
          if (last) env.delete(name);     // its buffer is the worker's now
        }
      }
      const { send, keep } = destinations(step);
      // A worker runs its jobs in the order they come, so a CU of the same worker that reads what
      // this one keeps can go now, behind it, instead of after this one's answer has come back
      // here: a worker's chain then runs without a round trip to a busy calling thread per CU.
      for (const name of keep) {
        keptOn.set(name, t);
        for (const reader of new Set(scheduler.readers.get(name) ?? [])) {
          const count = waiting.get(reader);
          if (count === undefined || threadOf(stepOf.get(reader)) !== t) continue;
          early.add(`${name}\0${reader}`);
          if (count === 1) {
            waiting.delete(reader);
            ready.push(stepOf.get(reader));
          } else {
            waiting.set(reader, count - 1);
          }
        }
      }
      inFlight += 1;
      this.post(step.unit, { inputs, send, keep, request }, transfer).then(({ outputs: results, startMs, seconds }) => {
        inFlight -= 1;
        for (const name in results) ours.add(name);
        done(step, results, keep, startMs, seconds);
        wake();
      }, (error) => {
        inFlight -= 1;
        failure ??= error;
        wake();
      });
    };
    while (left > 0) {
      if (failure !== null) throw failure;
      // Every worker's CU that can go, those a post makes ready included, before this thread runs one.
      for (let i = ready.findIndex((step) => step.unit instanceof RemoteUnit); i >= 0;
        i = ready.findIndex((step) => step.unit instanceof RemoteUnit)) {
        post(ready.splice(i, 1)[0]);
      }
      const here = ready.splice(0, ready.length);
      if (here.length) {
        const [step, ...later] = here;
        ready.push(...later);
        const inputs = Object.fromEntries(step.cu.inputs.map((name) => [name, env.get(name)]));
        for (const name of new Set(step.cu.inputs)) read(name);
        const start = clock();
        let results = step.unit.run(inputs);
        if (results instanceof Promise) results = await results;
        done(step, results, [], start, (clock() - start) / 1000);
        // Answers that came while this thread ran: a worker idle on one gets its next CU now.
        if (inFlight > 0) await messagesTaken();
        continue;
      }
      if (left > 0 && ready.length === 0 && failure === null) await new Promise((resolve) => { wake = () => resolve(undefined); });
    }
    if (failure !== null) throw failure;
    state.activated.sort((/** @type {any} */ a, /** @type {any} */ b) => a.start - b.start);
    /** @type {Record<string, Tensor>} */
    const results = {};
    for (const name of outputs) results[name] = copied(env.get(name));
    return { results, request: state };
  }

  /** The trace's `threads` for a request on `dag`. @param {import("./dag.js").Dag} dag
   * @param {string | null} sequential why the request walked sequentially (null: it did not) */
  trace(dag, sequential) {
    const owner = this.owners.get(dag) ?? new Map();
    // A section whose CUs all stay here walks as numThreads 1 does: sequentially, saying why.
    const because = this.oneThread.get(dag) ?? sequential;
    return { walk: because === null ? "threaded" : "sequential", cu_threads: this.threads, kernel_threads: 1,
      split_cus: dag.cus.filter((cu) => splitsKernels(/** @type {any} */ (cu.artifacts?.wasm))).map((cu) => cu.id),
      mode: "cu-workers", threads: this.threads, cu_thread: Object.fromEntries(owner),
      ...(because === null ? {} : { sequential_because: because }) };
  }

  /** Makes a worker fail the next run of a CU it owns: its `kind` "trap" throws there, "exit" ends
   * the worker. The tests' way to fail a worker. @param {string} cuId @param {"trap" | "exit"} kind */
  async injectFault(cuId, kind) {
    const found = [...this.owned].reverse().find(([, o]) => o.cu.id === cuId);
    if (found === undefined) throw new CortexError(`${cuId} is not a worker's CU`);
    (await this.worker(found[1].thread)).post({ fault: found[0], kind });
  }

  /** Ends every worker and forgets the CUs they owned, modules included (release: the sections are
   * instantiated again, and their CUs given out again, by the next request). */
  async close() {
    this.owned.clear();
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
      this.worker = startWorker(await workerClass(), WORKER_URL, { name: `cu-worker-${thread}`,
        onMessage: (m) => this.message(m, started, base), onError: (why) => this.fail(`stopped: ${why}`),
        onExit: (code) => this.fail(`exited (code ${code})`) });
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

  /** @param {RemoteUnit} unit @param {{inputs: Record<string, any>, send: string[], keep: string[], request?: number}} job
   * @param {Transferable[]} transfer */
  run(unit, job, transfer) {
    if (this.ended) return Promise.reject(new CortexError(`${unit.cu.id}: CU worker ${this.thread} has ended`));
    const id = this.nextJob++;
    return new Promise((resolve, reject) => {
      this.jobs.set(id, { resolve, reject, cu: unit.cu });
      this.idle();
      this.post({ run: id, key: unit.key, ...job }, transfer);
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
