// One kernel thread of a CU built with --wasm-features threads (js/src/kernel_threads.js starts it,
// a Web Worker in browsers, a worker_threads Worker in Node). It gets the CU's compiled module, its
// shared memory, its thread id and a shared buffer to report a trap in; instantiates the module
// against that memory (the same instance the caller has, in a thread of its own), says it is ready
// and parks in the module's `work` export, which takes parts of each job the caller publishes and
// returns when the caller's instance calls `stop`.
// A trap in a part: the reason goes into the report buffer (the first thread to fail wins), then
// the instance's `fail` sets the job's abort flag, so the caller, waiting for the job, traps too and
// reads the reason synchronously, before any message could arrive. The thread then goes back to
// `work` until `stop`, as the Python host's workers do (backends/wasm/kernel_threads.py).
// No imports: the file runs as a classic script or a module, in a browser or in Node.

const REPORT_HEADER = 8;      // the failed thread's id (0: none yet, -1: being written), the reason's length

/** The channel to the thread that started this one. */
async function parentChannel() {
  if (typeof WorkerGlobalScope !== "undefined") {
    return {
      post: (/** @type {any} */ message) => postMessage(message),
      once: (/** @type {(data: any) => void} */ handle) => addEventListener("message",
        (/** @type {any} */ event) => handle(event.data), { once: true }),
    };
  }
  const { parentPort } = await import("node:worker_threads");
  const port = /** @type {import("node:worker_threads").MessagePort} */ (parentPort);
  return { post: (/** @type {any} */ message) => port.postMessage(message), once: (/** @type {any} */ handle) => port.once("message", handle) };
}

/** Writes why thread `tid` trapped into the report buffer, unless another thread already did.
 * @param {SharedArrayBuffer} report @param {number} tid @param {any} error */
function report(report, tid, error) {
  const words = new Int32Array(report, 0, 2);
  if (Atomics.compareExchange(words, 0, 0, -1) !== 0) return;
  const text = new TextEncoder().encode(String(error?.message ?? error)).subarray(0, report.byteLength - REPORT_HEADER);
  new Uint8Array(report, REPORT_HEADER).set(text);
  Atomics.store(words, 1, text.length);
  Atomics.store(words, 0, tid);
}

/** @param {{module: WebAssembly.Module, memory: WebAssembly.Memory, tid: number, report: SharedArrayBuffer}} job
 * @param {{post: (message: any) => void}} parent */
function work({ module, memory, tid, report: failures }, parent) {
  let exports;
  try {
    exports = /** @type {any} */ (new WebAssembly.Instance(module, { env: { memory } })).exports;
  } catch (e) {
    parent.post({ error: String(/** @type {any} */ (e)?.message ?? e) });
    return;
  }
  parent.post({ ready: true });
  for (;;) {
    try {
      exports.work(tid);
      break;                              // the caller's instance called `stop`
    } catch (e) {
      report(failures, tid, e);
      exports.fail();
    }
  }
  parent.post({ stopped: true });
}

parentChannel().then((parent) => parent.once((/** @type {any} */ job) => work(job, parent)));
