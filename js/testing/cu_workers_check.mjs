// Runs a build on CU workers for tests/test_js_cu_workers.py and bench/cu_workers_bench.py:
//   node --experimental-wasm-relaxed-simd js/testing/cu_workers_check.mjs JOB.json
// JOB: {"dag", "folder", "inputs": {NAME: {dtype, shape, file}}, "out", "numThreads": [N, ...],
//       "policy", "fault": "trap" | "exit" | null, "release": bool, "no_shared_memory": bool,
//       "timing": {"rounds": R, "traces": bool} | null}
// For each N: a session with `numThreads: N` runs the inputs (outputs to OUT/nN-NAME.bin, its trace
// kept); with "fault", a worker's CU is made to fail (a trap, or its worker ends), the error kept,
// and the inputs run again (OUT/nN-fault-NAME.bin); with "release", the session is released and
// runs again (OUT/nN-release-NAME.bin). "no_shared_memory" stands for a page that is not
// crossOriginIsolated: SharedArrayBuffer throws when constructed (counted). "timing": the sessions stay
// open and run in turn, R rounds, each request's milliseconds and the process's CPU milliseconds
// kept (and with "traces" its trace). Prints one JSON line: {"runs": {N: {"trace", "fault_error",
// "fault_cu", "workers_started"}}, "ms": {N: [...]}, "cpu_ms": {N: [...]}, "traces": {N: [...]},
// "shared_array_buffers": count}.
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
// Node's worker_threads makes a SharedArrayBuffer of its own when it loads: before the stub below.
import "node:worker_threads";
import { InferenceSession } from "../src/index.js";
import { readTensors } from "./cases.js";

const job = JSON.parse(readFileSync(process.argv[2], "utf8"));
let sharedArrayBuffers = 0;
if (job.no_shared_memory) {
  /** @type {any} */ (globalThis).crossOriginIsolated = false;
  /** @type {any} */ (globalThis).SharedArrayBuffer = function SharedArrayBuffer() {
    sharedArrayBuffers += 1;
    throw new TypeError("SharedArrayBuffer is not available on this page");
  };
}
const feeds = readTensors(job, job.inputs);
const policy = job.policy ?? "strict";

/** @param {number} n @param {string} label @param {Record<string, any>} outputs */
function save(n, label, outputs) {
  for (const [name, tensor] of Object.entries(outputs)) {
    const { buffer, byteOffset, byteLength } = tensor.data;
    writeFileSync(path.join(job.out, `n${n}${label}-${name.replaceAll("/", "_")}.bin`), new Uint8Array(buffer, byteOffset, byteLength));
  }
}

/** @type {Record<number, any>} */
const runs = {};
/** @type {Record<number, number[]>} */
const ms = {};
/** @type {Record<number, any[]>} */
const traces = {};
/** @type {Record<number, number[]>} the process's CPU time (every thread) per timed request */
const cpuMs = {};
/** @type {Map<number, InferenceSession>} */
const sessions = new Map();
for (const n of job.numThreads) {
  const session = await InferenceSession.create(job.dag, { numThreads: n, policy });
  const run = { trace: null, fault_error: null, fault_cu: null, workers_started: 0 };
  save(n, "", await session.run(feeds));
  run.trace = session.lastTrace;
  run.workers_started = session.cuWorkers?.handles.filter((h) => h !== null).length ?? 0;
  if (job.fault && session.cuWorkers !== null) {
    const cu = Object.entries(run.trace.threads.cu_thread).find(([, t]) => t > 0)?.[0];
    run.fault_cu = cu ?? null;
    await session.cuWorkers.injectFault(/** @type {string} */ (cu), job.fault);
    try {
      await session.run(feeds);
    } catch (e) {
      run.fault_error = /** @type {any} */ (e).message;
    }
    save(n, "-fault", await session.run(feeds));
  }
  if (job.release) {
    await session.release();
    save(n, "-release", await session.run(feeds));
  }
  runs[n] = run;
  if (job.timing) sessions.set(n, session); else await session.release();
}
if (job.timing) {
  for (let round = 0; round < job.timing.rounds; round++) {
    for (const [n, session] of sessions) {
      const [start, cpu] = [performance.now(), process.cpuUsage()];
      await session.run(feeds);
      (ms[n] ??= []).push(performance.now() - start);
      const used = process.cpuUsage(cpu);
      (cpuMs[n] ??= []).push((used.user + used.system) / 1000);
      if (job.timing.traces) (traces[n] ??= []).push(session.lastTrace);
    }
  }
  for (const session of sessions.values()) await session.release();
}
console.log(JSON.stringify({ runs, ms, cpu_ms: cpuMs, traces, shared_array_buffers: sharedArrayBuffers }));
