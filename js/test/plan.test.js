// Request plans (js/src/plan.js): runs of CUs that need no decision from the host are segments,
// one loop each, with the outputs, trace and trap messages a CU-by-CU walk gives.
import assert from "node:assert/strict";
import { test } from "node:test";
import { CortexError, InferenceSession } from "../src/index.js";
import { Segment } from "../src/plan.js";
import { SKIP, assertClose, loadCases, readTensors } from "../testing/cases.js";

const cases = loadCases();

test("cases were given", { skip: SKIP }, () => assert.ok(cases.length > 0));

/** The segments of the plan the session's last request ran. @param {InferenceSession} session */
const segmentsOf = (session) => [...session.scheduler.plans.values()].at(-1)?.items
  .filter((item) => item instanceof Segment) ?? [];

for (const c of cases.filter((k) => k.segment !== undefined)) {
  test(`${c.name}: strict and balanced run the whole chain as one segment, with one trace entry per CU`, async () => {
    for (const policy of ["strict", "balanced"]) {
      const session = await InferenceSession.create(c.dag, { policy });
      for (const [i, request] of c.requests.entries()) {
        const got = await session.run(readTensors(c, request.inputs));
        const want = readTensors(c, request.outputs);
        for (const name of Object.keys(want)) assertClose(got[name], want[name], c.rtol, c.atol, `${policy} request ${i} ${name}`);
        const segments = segmentsOf(session);
        assert.deepEqual(segments.map((s) => s.steps.length), [c.segment], policy);
        const trace = session.lastTrace;
        assert.deepEqual(trace.activated_cus, session.dag.order);
        assert.ok(trace.cus.every((/** @type {any} */ t) => t.segment === c.segment && t.seconds >= 0 && t.resident_bytes > 0));
        assert.deepEqual(trace.skipped_cus, []);
        // The chain's input changes with every request and nothing is marked repeating: nothing is keyed.
        if (policy === "balanced") assert.deepEqual(session.cache.stats(), { ...session.cache.stats(), entries: 0, hits: 0, misses: 0 });
      }
    }
  });
}

for (const c of cases.filter((k) => k.trap !== undefined)) {
  test(`${c.name}: a trap inside a segment names its CU, and the session still serves`, async () => {
    for (const policy of ["strict", "balanced"]) {
      const session = await InferenceSession.create(c.dag, { policy });
      const [request] = c.requests;
      const good = readTensors(c, request.inputs);
      const want = readTensors(c, request.outputs);
      const check = async () => {
        const got = await session.run(good);
        for (const name of Object.keys(want)) assertClose(got[name], want[name], 0, 0, `${policy} ${name}`);
      };
      await check();
      const segments = segmentsOf(session);
      assert.equal(segments.length, 1, policy);
      const ids = segments[0].steps.map((s) => s.id);
      assert.ok(ids.length > 1 && ids.indexOf(c.trap.cu) > 0, `${c.trap.cu} lies inside the segment ${ids}`);
      await assert.rejects(session.run(readTensors(c, c.trap.inputs)), (/** @type {any} */ e) => e instanceof CortexError
        && new RegExp(`^${c.trap.cu} \\(${c.trap.ops}\\) trapped: .*divide by zero`).test(e.message)
        || assert.fail(`${e?.name}: ${e?.message}`));
      await check();
    }
  });
}

for (const c of cases.filter((k) => k.name === "repeating-inputs")) {
  test(`${c.name}: the CUs marked repeating hit the cache when their inputs repeat; the others run`, async () => {
    const session = await InferenceSession.create(c.dag, { policy: "balanced" });
    const repeating = session.dag.cus.filter((cu) => cu.cache === "repeating").map((cu) => cu.id).sort();
    const [first, second] = c.requests;
    // The second request's repeating inputs (m, mask) are the first's, its changing one (x) its own.
    const feeds = { ...readTensors(c, second.inputs), m: readTensors(c, first.inputs).m, mask: readTensors(c, first.inputs).mask };
    await session.run(readTensors(c, first.inputs));
    assert.deepEqual(session.lastTrace.skipped_cus, []);
    assert.equal(session.cache.stats().entries, repeating.length, "only the repeating CUs are stored");
    const again = await session.run(readTensors(c, first.inputs));
    assert.deepEqual(session.lastTrace.skipped_cus.map((/** @type {any} */ s) => s.cu).sort(), repeating);
    const want = readTensors(c, first.outputs);
    for (const name of Object.keys(want)) assertClose(again[name], want[name], c.rtol, c.atol, name);
    await session.run(feeds);
    const hits = session.lastTrace.skipped_cus.map((/** @type {any} */ s) => s.cu).sort();
    assert.deepEqual(hits, repeating);
    assert.deepEqual(session.lastTrace.activated_cus.slice().sort(),
      session.dag.order.filter((id) => !repeating.includes(id)).sort());
    // Entries are views of the repeating CUs' output slots, until those CUs run again: then copies,
    // so the first request's results still come back from the cache after other inputs ran.
    const entries = [...session.cache.entries.values()];
    assert.ok(entries.every((e) => e.byReference), "stored without a copy");
    const other = readTensors(c, second.inputs);
    await session.run(other);                   // new m and mask: every repeating CU runs again
    assert.ok(entries.every((e) => !e.byReference), "copied before their CUs ran again");
    const back = await session.run(readTensors(c, first.inputs));
    assert.deepEqual(session.lastTrace.skipped_cus.map((/** @type {any} */ s) => s.cu).sort(), repeating);
    for (const name of Object.keys(want)) assertClose(back[name], want[name], c.rtol, c.atol, name);
  });
}
