// What the runtime adds around the modules on a `strict` request: `node js/testing/cu_overhead.mjs
// DAG.json [RUNS]` runs the example inputs RUNS times and splits each request's wall time into the
// modules' `run` calls and the runtime's own work (copying each CU's inputs into its own memory,
// the scheduler and the trace: a segment of the request plan does its copies and calls in one
// loop, so they are not told apart); prints the means over the quietest quarter of runs.
// With `--without-modules` every module's `run` is a no-op, so that what is left of a request is
// the runtime's own work, timed without the modules' noise on a busy machine.
// With `--per-cu` (bench/cu_overhead.py) it times whole requests instead, `strict` and `balanced`
// interleaved, each on fresh random inputs (every cache lookup a miss), and prints the median
// process CPU time per request and per CU of each.
import { InferenceSession, Tensor, exampleFeeds } from "../src/index.js";

const flags = new Set(process.argv.slice(2).filter((a) => a.startsWith("--")));
const without = flags.has("--without-modules");
const [dag, runs = "40"] = process.argv.slice(2).filter((a) => !a.startsWith("--"));
if (flags.has("--per-cu")) {
  await perCU(dag, Number(runs));
  process.exit(0);
}
const session = await InferenceSession.create(dag, { policy: "strict" });
const feeds = exampleFeeds(session.inputMetadata);
let inCalls = 0;
// Before the first request, which makes the plans that hold each unit's `call`.
for (const unit of /** @type {Map<string, any>} */ (session.scheduler.units).values()) {
  if (typeof unit.call !== "function") continue;          // a fallback CU: onnxruntime-web's own
  const call = without ? () => {} : unit.call;
  unit.call = () => {
    const t = performance.now();
    call();
    inCalls += performance.now() - t;
  };
}
for (let i = 0; i < 5; i++) await session.run(feeds);      // tier-up
const rows = [];
for (let i = 0; i < Number(runs); i++) {
  inCalls = 0;
  const t = performance.now();
  await session.run(feeds);
  const wall = performance.now() - t;
  rows.push({ wall, modules: inCalls, runtime: wall - inCalls });
}
rows.sort((a, b) => a.wall - b.wall);
const quiet = rows.slice(0, Math.max(1, rows.length >> 2));
const mean = (/** @type {"wall"|"modules"|"runtime"} */ k) => +(quiet.reduce((n, r) => n + r[k], 0) / quiet.length).toFixed(2);
console.log(JSON.stringify({ cus: session.dag.cus.length, wall_ms: mean("wall"), modules_ms: mean("modules"),
  runtime_ms: mean("runtime") }));

/** strict and balanced, interleaved request by request, on fresh random float inputs. */
async function perCU(/** @type {string} */ dagPath, /** @type {number} */ rounds) {
  const sessions = { strict: await InferenceSession.create(dagPath, { policy: "strict" }),
    balanced: await InferenceSession.create(dagPath, { policy: "balanced" }) };
  const specs = sessions.strict.inputMetadata;
  const fresh = () => Object.fromEntries(specs.map((/** @type {any} */ spec) => {
    const n = spec.shape.reduce((/** @type {number} */ a, /** @type {number} */ b) => a * b, 1);
    const data = new Float32Array(n);
    for (let i = 0; i < n; i++) data[i] = Math.random() * 2 - 1;
    return [spec.name, new Tensor(spec.dtype, data, spec.shape)];
  }));
  const cpuMs = () => {
    const { user, system } = process.cpuUsage();
    return (user + system) / 1e3;
  };
  for (const session of Object.values(sessions)) for (let i = 0; i < 20; i++) await session.run(fresh());   // tier-up
  /** @type {Record<string, number[]>} */
  const samples = { strict: [], balanced: [] };
  for (let r = 0; r < rounds; r++) {
    for (const [name, session] of Object.entries(sessions)) {
      const feeds = fresh();
      const start = cpuMs();
      await session.run(feeds);
      samples[name].push(cpuMs() - start);
    }
  }
  const cus = sessions.strict.dag.cus.length;
  const median = (/** @type {number[]} */ xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  console.log(JSON.stringify({ cus, ...Object.fromEntries(Object.entries(samples).map(([k, v]) =>
    [k, { request_ms: median(v), us_per_cu: median(v) * 1e3 / cus }])) }));
}
