// Every compiled case reproduces onnxruntime's outputs, under strict and under balanced, where a
// repeated request is served from the result cache with the same bytes where a hit is possible
// (the CUs dag.json marks repeating, and those chained from them).
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { InferenceSession } from "../src/index.js";
import { SKIP, assertClose, loadCases, onnxruntimeWeb, readTensors } from "../testing/cases.js";

const cases = loadCases();
const ort = await onnxruntimeWeb();

test("cases were given", { skip: SKIP }, () => assert.ok(cases.length > 0));

for (const c of cases) {
  const skip = c.fallback && !ort && "a fallback case needs onnxruntime-web (CORTEX_JS_ORTWEB)";
  const options = c.fallback ? { onnxruntime: ort } : {};
  test(`${c.name} matches onnxruntime`, { skip }, async () => {
    const session = await InferenceSession.create(c.dag, { ...options, policy: "strict" });
    for (const [i, request] of c.requests.entries()) {
      const feeds = readTensors(c, request.inputs);
      const got = await session.run(feeds, request.fetches ?? undefined);
      const want = readTensors(c, request.outputs);
      assert.deepEqual(Object.keys(got).sort(), Object.keys(want).sort());
      for (const name of Object.keys(want)) assertClose(got[name], want[name], c.rtol, c.atol, `${c.name} request ${i} ${name}`);
      const trace = session.lastTrace;
      assert.equal(trace.policy, "strict");
      assert.equal(trace.cache, null);
      assert.deepEqual(trace.activated_cus, session.dag.order);      // strict runs every CU, in order
      assert.equal(trace.cus.length, session.dag.order.length);
      const fallback = session.dag.cus.filter((cu) => cu.runs_on).map((cu) => cu.id).sort();
      assert.deepEqual(trace.fell_back_cus.map((/** @type {any} */ f) => f.cu).sort(), fallback);
      const crossing = trace.cus.filter((/** @type {any} */ t) => t.bytes_from_other_devices > 0).length;
      assert.equal(crossing > 0, fallback.length > 0, "tensors cross devices exactly when a fallback CU runs");
      assert.ok(trace.cus.every((/** @type {any} */ t) => t.seconds >= 0 && (t.device !== "wasm" || t.resident_bytes > 0)));
    }
  });

  test(`${c.name} under balanced: skips what the request does not need, then hits the cache where a hit is possible`,
    { skip }, async () => {
    const session = await InferenceSession.create(c.dag, options);
    const repeating = new Set(session.dag.cus.filter((cu) => cu.cache === "repeating").map((cu) => cu.id));
    for (const [i, request] of c.requests.entries()) {
      const feeds = readTensors(c, request.inputs);
      const want = readTensors(c, request.outputs);
      session.cache.clear();
      const first = await session.run(feeds, request.fetches ?? undefined);
      const skipped = (/** @type {string} */ reason) => session.lastTrace.skipped_cus
        .filter((/** @type {any} */ s) => s.reason === reason).map((/** @type {any} */ s) => s.cu).sort();
      assert.deepEqual(skipped("inactive branch"), [...request.inactive].sort(), `request ${i}: inactive`);
      assert.deepEqual(skipped("not needed"), [...request.not_needed].sort(), `request ${i}: not needed`);
      for (const name of Object.keys(want)) assertClose(first[name], want[name], c.rtol, c.atol, `${c.name} ${name}`);
      const ran = session.lastTrace.activated_cus;
      if (process.env.CORTEX_JS_TRACES) {      // the Python side checks them against trace.schema.json
        writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-${i}.json`), JSON.stringify(session.lastTrace));
      }
      const again = await session.run(feeds, request.fetches ?? undefined);
      const hits = skipped("cache hit");
      // Only CUs dag.json marks repeating (decompose --cache-inputs), and those chained from them, are
      // keyed: in a dag.json that marks nothing every CU runs again.
      assert.deepEqual([...session.lastTrace.activated_cus, ...hits].sort(), [...ran].sort());
      assert.deepEqual(hits.filter((id) => repeating.has(id)), ran.filter((id) => repeating.has(id)).sort());
      if (!repeating.size) assert.equal(session.cache.stats().entries, 0, "nothing stored where no hit is possible");
      for (const name of Object.keys(want)) assert.deepEqual(again[name].data, first[name].data, `${name}: cached bytes`);
      assert.notEqual(again[Object.keys(want)[0]].data, first[Object.keys(want)[0]].data);   // the caller's own copy
    }
  });
}
