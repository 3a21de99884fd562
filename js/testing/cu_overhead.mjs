// What the runtime adds around the modules on a `strict` request: `node js/testing/cu_overhead.mjs
// DAG.json [RUNS]` runs the example inputs RUNS times and splits each request's wall time into the
// modules' `run` calls, the rest of each CU's run (copying its inputs into its own memory, the
// output views) and the scheduler and trace; prints the means over the quietest quarter of runs.
// With `--without-modules` every module's `run` is a no-op, so that what is left of a request is
// the runtime's own work, timed without the modules' noise on a busy machine.
import { InferenceSession, exampleFeeds } from "../src/index.js";

const without = process.argv.includes("--without-modules");
const [dag, runs = "40"] = process.argv.slice(2).filter((a) => a !== "--without-modules");
const session = await InferenceSession.create(dag, { policy: "strict" });
const feeds = exampleFeeds(session.inputMetadata);
let inCalls = 0, inUnits = 0;
for (const unit of /** @type {Map<string, any>} */ (session.scheduler.units).values()) {
  if (typeof unit.call !== "function") continue;          // a fallback CU: onnxruntime-web's own
  const call = without ? () => {} : unit.call, run = unit.run.bind(unit);
  unit.call = () => {
    const t = performance.now();
    call();
    inCalls += performance.now() - t;
  };
  unit.run = (/** @type {any} */ inputs) => {
    const t = performance.now();
    const outputs = run(inputs);
    inUnits += performance.now() - t;
    return outputs;
  };
}
for (let i = 0; i < 5; i++) await session.run(feeds);      // tier-up
const rows = [];
for (let i = 0; i < Number(runs); i++) {
  inCalls = 0;
  inUnits = 0;
  const t = performance.now();
  await session.run(feeds);
  const wall = performance.now() - t;
  rows.push({ wall, modules: inCalls, copies: inUnits - inCalls, scheduler: wall - inUnits });
}
rows.sort((a, b) => a.wall - b.wall);
const quiet = rows.slice(0, Math.max(1, rows.length >> 2));
const mean = (/** @type {"wall"|"modules"|"copies"|"scheduler"} */ k) => +(quiet.reduce((n, r) => n + r[k], 0) / quiet.length).toFixed(2);
console.log(JSON.stringify({ cus: session.dag.cus.length, wall_ms: mean("wall"), modules_ms: mean("modules"),
  copies_ms: mean("copies"), scheduler_ms: mean("scheduler") }));
