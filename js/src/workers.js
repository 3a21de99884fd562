// Workers the same way in browsers (Web Workers) and in Node (worker_threads), for the three kinds
// the runtime starts: CU workers (cu_workers.js), kernel threads (kernel_threads.js) and a proxied
// session (proxy.js); and, inside a Worker, the channel back to the thread that started it.
export const IN_NODE = typeof process !== "undefined" && !!process.versions?.node;

/** The Worker constructor of this engine. */
export async function workerClass() {
  return IN_NODE ? (await import("node:worker_threads")).Worker : globalThis.Worker;
}

/**
 * A Worker running the script at `url`, its messages to `onMessage`, an error in it to `onError`
 * (its message) and, in Node, its exit to `onExit` (the exit code; a Web Worker that ends says nothing).
 * @param {any} WorkerClass from `workerClass()` @param {URL} url
 * @param {{name: string, module?: boolean, onMessage: (data: any) => void, onError: (message: string) => void,
 *   onExit: (code: number) => void}} options `module`: a module Web Worker (true by default), else a classic one
 */
export function startWorker(WorkerClass, url, { name, module = true, onMessage, onError, onExit }) {
  const worker = IN_NODE ? new WorkerClass(url) : new WorkerClass(url, module ? { type: "module", name } : { name });
  if (IN_NODE) {
    worker.on("message", onMessage);
    worker.on("error", (/** @type {any} */ e) => onError(String(e?.message ?? e)));
    worker.on("exit", onExit);
  } else {
    worker.addEventListener("message", (/** @type {MessageEvent} */ e) => onMessage(e.data));
    worker.addEventListener("error", (/** @type {any} */ e) => onError(e?.message ?? "it did not load"));
  }
  return worker;
}

/** Inside a Worker: the channel to the thread that started it. (kernel_worker.js keeps its own: it
 * runs as a classic script too, without imports.) */
export async function parentChannel() {
  if (typeof WorkerGlobalScope !== "undefined") {
    return {
      post: (/** @type {any} */ message, /** @type {Transferable[]} */ transfer = []) => postMessage(message, { transfer }),
      listen: (/** @type {(data: any) => void} */ handle) => addEventListener("message", (/** @type {any} */ e) => handle(e.data)),
      exit: () => close(),
    };
  }
  const { parentPort } = await import("node:worker_threads");
  const port = /** @type {import("node:worker_threads").MessagePort} */ (parentPort);
  return {
    post: (/** @type {any} */ message, /** @type {any[]} */ transfer = []) => port.postMessage(message, transfer),
    listen: (/** @type {(data: any) => void} */ handle) => port.on("message", handle),
    exit: () => process.exit(1),
  };
}
