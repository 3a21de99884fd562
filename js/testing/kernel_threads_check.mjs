// Runs a `--wasm-features threads` build on the JavaScript runtime for tests/test_js_threads.py:
//   node --experimental-wasm-relaxed-simd js/testing/kernel_threads_check.mjs JOB.json
// JOB: {"dag", "folder", "inputs": {NAME: {dtype, shape, file}}, "out", "threads": [N, ...],
//       "fault": bool, "release": bool, "not_isolated": bool, "main_thread": bool}
// For each N: a session with `threads: N` runs the inputs (outputs to OUT/tN-NAME.bin); with
// "fault", a worker is made to trap after part 0, 1, ... of a job in turn until one does (bounded:
// which parts a worker claims depends on when it wakes), the error kept, and the
// inputs run again (OUT/tN-fault-NAME.bin); with "release", the session is released and runs again
// (OUT/tN-release-NAME.bin). "not_isolated" stands for a browser page that is not
// crossOriginIsolated, "main_thread" for a page's main thread (Atomics.wait throws). Prints one
// JSON line: {"runs": {N: {"trace", "fault_error", "fault_attempts"}}, "create_errors": {N: message}}.
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
import { CortexError, InferenceSession } from "../src/index.js";
import { readTensors } from "./cases.js";

const FAULT_ATTEMPTS = 50;       // a part is a worker's only when it claims it first

const job = JSON.parse(readFileSync(process.argv[2], "utf8"));
if (job.not_isolated) /** @type {any} */ (globalThis).crossOriginIsolated = false;
if (job.main_thread) {
  Atomics.wait = () => { throw new TypeError("Atomics.wait cannot be called in this context"); };
}
const feeds = readTensors(job, job.inputs);

/** @param {number} threads @param {string} label @param {Record<string, any>} outputs */
function save(threads, label, outputs) {
  for (const [name, tensor] of Object.entries(outputs)) {
    const { buffer, byteOffset, byteLength } = tensor.data;
    writeFileSync(path.join(job.out, `t${threads}${label}-${name}.bin`), new Uint8Array(buffer, byteOffset, byteLength));
  }
}

/** @type {Record<number, any>} */
const runs = {};
/** @type {Record<number, string>} */
const createErrors = {};
for (const threads of job.threads) {
  let session;
  try {
    session = await InferenceSession.create(job.dag, { threads, policy: "strict" });
  } catch (e) {
    if (!(e instanceof CortexError)) throw e;
    createErrors[threads] = e.message;
    continue;
  }
  const run = { trace: null, fault_error: null, fault_attempts: 0 };
  save(threads, "", await session.run(feeds));
  run.trace = session.lastTrace;
  if (job.fault) {
    const units = [...session.kernelThreads.units];
    for (; run.fault_attempts < FAULT_ATTEMPTS && run.fault_error === null; run.fault_attempts++) {
      units[0].injectFault(run.fault_attempts % units[0].plan.threads.parts);
      try {
        await session.run(feeds);
      } catch (e) {
        run.fault_error = /** @type {any} */ (e).message;
      }
    }
    save(threads, "-fault", await session.run(feeds));
  }
  if (job.release) {
    await session.release();
    save(threads, "-release", await session.run(feeds));
  }
  await session.release();
  runs[threads] = run;
}
console.log(JSON.stringify({ runs, create_errors: createErrors }));
