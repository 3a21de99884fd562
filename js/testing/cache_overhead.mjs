// What the result cache costs a request that misses: `node js/testing/cache_overhead.mjs DAG.json
// [ROUNDS]` runs the example inputs on a `strict` session (no cache) and on a `balanced` one whose
// cache is cleared before each request (every CU hashes its inputs' keys and stores its outputs,
// none hits), alternating; prints the process CPU time per request (median, min, max over ROUNDS)
// and the ratio of the medians.
import { InferenceSession, exampleFeeds } from "../src/index.js";

const [dag, rounds = "15"] = process.argv.slice(2);
const cpuMs = () => {
  const { user, system } = process.cpuUsage();
  return (user + system) / 1e3;
};
const sessions = { strict: await InferenceSession.create(dag, { policy: "strict" }),
  balanced: await InferenceSession.create(dag, { policy: "balanced" }) };
const feeds = exampleFeeds(sessions.strict.inputMetadata);
for (const session of Object.values(sessions)) for (let i = 0; i < 4; i++) await session.run(feeds);   // tier-up
/** @type {Record<string, number[]>} */
const samples = { strict: [], balanced: [] };
for (let r = 0; r < Number(rounds); r++) {
  for (const [name, session] of Object.entries(sessions)) {
    session.cache.clear();
    const start = cpuMs();
    await session.run(feeds);
    samples[name].push(cpuMs() - start);
  }
}
/** @param {number[]} xs */
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const result = Object.fromEntries(Object.entries(samples).map(([k, v]) => [k,
  { median_ms: +median(v).toFixed(1), min_ms: +Math.min(...v).toFixed(1), max_ms: +Math.max(...v).toFixed(1) }]));
console.log(JSON.stringify({ ...result, balanced_miss_over_strict: +(median(samples.balanced) / median(samples.strict)).toFixed(2) }));
