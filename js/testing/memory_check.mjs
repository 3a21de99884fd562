// Runs a model under memory budgets and releases it, for tests/test_js_memory.py and the figures
// in docs/runtime.md:
//   node --expose-gc js/testing/memory_check.mjs JOB.json
// JOB: {"dag", "folder", "inputs": {NAME: {dtype, shape, file}}, "out", "budgets_mb": [MB, ...],
//       "too_small_mb": MB | null, "repeats": N}
// Writes OUT/full-NAME.bin (no budget), OUT/again-NAME.bin (the same session after release()),
// OUT/bMB-NAME.bin (under each budget). Prints one JSON line: {"rss": {"before_create",
// "after_run", "after_release"} in bytes, "resident_after_run", "resident_after_release",
// "full": {"ms", "trace"}, "budgets": {MB: {"ms", "trace", "resident_after_release"}},
// "too_small_error": message | null}. Times are the median of `repeats` runs after a first one.
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
import { CortexError, InferenceSession } from "../src/index.js";
import { readTensors } from "./cases.js";

const job = JSON.parse(readFileSync(process.argv[2], "utf8"));
const feeds = readTensors(job, job.inputs);
const repeats = job.repeats ?? 3;

/** Collected garbage, several times with turns of the event loop between: a dropped memory is
 * unmapped by the collection that finds it unreachable. */
async function collected() {
  for (let i = 0; i < 4; i++) {
    /** @type {any} */ (globalThis).gc();
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  return process.memoryUsage().rss;
}

/** @param {string} label @param {Record<string, any>} outputs */
function save(label, outputs) {
  for (const [name, tensor] of Object.entries(outputs)) {
    const { buffer, byteOffset, byteLength } = tensor.data;
    writeFileSync(path.join(job.out, `${label}-${name}.bin`), new Uint8Array(buffer, byteOffset, byteLength));
  }
}

/** The session's first run saved as `label`, then the median time of `repeats` more. @param {any} session @param {string} label */
async function timed(session, label) {
  save(label, await session.run(feeds));
  const trace = session.lastTrace;
  const times = [];
  for (let i = 0; i < repeats; i++) {
    const start = performance.now();
    await session.run(feeds);
    times.push(performance.now() - start);
  }
  times.sort((a, b) => a - b);
  return { ms: times[Math.floor(times.length / 2)], trace, last_memory: session.lastTrace.memory };
}

const rss = { before_create: await collected(), after_run: 0, after_release: 0 };
const session = await InferenceSession.create(job.dag, { policy: "strict" });
const full = await timed(session, "full");
const residentAfterRun = session.residentBytes;
rss.after_run = await collected();
await session.release();
const residentAfterRelease = session.residentBytes;
rss.after_release = await collected();
save("again", await session.run(feeds));
await session.release();

/** @type {Record<string, any>} */
const budgets = {};
for (const mb of job.budgets_mb) {
  const budgeted = await InferenceSession.create(job.dag, { policy: "strict", memoryBudgetMB: mb });
  budgets[mb] = await timed(budgeted, `b${mb}`);
  await budgeted.release();
  budgets[mb].resident_after_release = budgeted.residentBytes;
}

let tooSmallError = null;
if (job.too_small_mb !== null && job.too_small_mb !== undefined) {
  try {
    await InferenceSession.create(job.dag, { memoryBudgetMB: job.too_small_mb });
  } catch (e) {
    if (!(e instanceof CortexError)) throw e;
    tooSmallError = e.message;
  }
}
console.log(JSON.stringify({ rss, resident_after_run: residentAfterRun, resident_after_release: residentAfterRelease,
  full, budgets, too_small_error: tooSmallError }));
