// What lazy instantiation of specializations costs: `node js/testing/specialization_timing.mjs
// DAG.json [ROUNDS]` creates a session on a cortex.dag/2 file, then runs each specialization's
// example inputs twice under `strict` (no cache); prints create time, each first request (which
// instantiates that section, except the first) against its second, as medians over ROUNDS sessions.
import { InferenceSession, exampleFeeds } from "../src/index.js";

const [dag, rounds = "5"] = process.argv.slice(2);
/** @param {number[]} xs */
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
/** @type {Record<string, number[]>} */
const samples = { create: [] };
for (let r = 0; r < Number(rounds); r++) {
  const t0 = performance.now();
  const session = await InferenceSession.create(dag, { policy: "strict" });
  samples.create.push(performance.now() - t0);
  for (const pass of ["first", "second"]) {
    for (const section of session.sections) {
      const feeds = exampleFeeds(section.dag.inputs);
      const t = performance.now();
      await session.run(feeds);
      (samples[`${section.name} ${pass}`] ??= []).push(performance.now() - t);
    }
  }
}
const result = Object.fromEntries(Object.entries(samples).map(([k, v]) => [`${k} ms`, +median(v).toFixed(3)]));
for (const name of new Set(Object.keys(samples).filter((k) => k.endsWith(" first")).map((k) => k.slice(0, -6)))) {
  result[`${name} first/second`] = +(median(samples[`${name} first`]) / median(samples[`${name} second`])).toFixed(2);
}
console.log(JSON.stringify(result, null, 1));
