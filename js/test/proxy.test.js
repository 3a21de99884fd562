// `proxy: true` (js/src/proxy.js): the session in a Worker of its own gives the in-thread session's
// bits, trace, progress and generated ids; its refusals read the same; release() ends the Worker and
// the session serves again.
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { CortexError, InferenceSession } from "../src/index.js";
import { SKIP, loadCases, readTensors } from "../testing/cases.js";

const cases = loadCases();
const plain = cases.filter((c) => !c.fallback && !c.generate && c.requests?.length);
const generating = cases.filter((c) => c.generate?.ids);

/** @param {() => Promise<unknown>} action @param {RegExp} message */
async function refuses(action, message) {
  await assert.rejects(action, (e) => (e instanceof CortexError && message.test(e.message) && !e.message.includes("\n"))
    || assert.fail(`${e?.name}: ${e?.message} does not match ${message}`));
}

/** @param {any} tensor */
const bytesOf = (tensor) => new Uint8Array(tensor.data.buffer, tensor.data.byteOffset, tensor.data.byteLength);

test("proxied sessions give the in-thread session's bits and trace, and serve again after release", { skip: SKIP || (!plain.length && "no cases") }, async () => {
  for (const c of plain.slice(0, 3)) {
    const events = [];
    const proxied = await InferenceSession.create(c.dag, { policy: "strict", proxy: true, onProgress: (e) => events.push(e) });
    const local = await InferenceSession.create(c.dag, { policy: "strict" });
    assert.ok(proxied.worker, `${c.name}: a Worker holds the session`);
    assert.deepEqual(proxied.inputNames, local.inputNames);
    assert.deepEqual(proxied.outputNames, local.outputNames);
    assert.deepEqual(proxied.inputMetadata, local.inputMetadata);
    assert.ok(events.length > 0, `${c.name}: progress crossed`);
    assert.deepEqual(events.at(-1), { bytes: events.at(-1).totalBytes, totalBytes: events.at(-1).totalBytes,
      cus: events.at(-1).totalCus, totalCus: events.at(-1).totalCus }, `${c.name}: progress ends at the totals`);
    for (let i = 1; i < events.length; i++) assert.ok(events[i].bytes >= events[i - 1].bytes, `${c.name}: progress never decreases`);
    for (const request of c.requests) {
      const feeds = readTensors(c, request.inputs);
      const [got, want] = [await proxied.run(feeds), await local.run(feeds)];
      assert.deepEqual(Object.keys(got), Object.keys(want));
      for (const name of Object.keys(want)) {
        assert.equal(got[name].type, want[name].type);
        assert.deepEqual([...got[name].dims], [...want[name].dims]);
        assert.deepEqual(bytesOf(got[name]), bytesOf(want[name]), `${c.name} ${name}: the same bits`);
      }
      if (process.env.CORTEX_JS_TRACES) {      // the Python side checks them against trace.schema.json
        writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-proxy-${c.requests.indexOf(request)}.json`),
          JSON.stringify(proxied.lastTrace));
      }
      assert.deepEqual(proxied.lastTrace.activated_cus, local.lastTrace.activated_cus);
      assert.deepEqual(proxied.lastTrace.threads, local.lastTrace.threads);
      assert.equal(proxied.residentBytes, local.residentBytes);
      for (const [name, tensor] of Object.entries(feeds)) assert.ok(tensor.data.byteLength > 0, `${name}: the caller keeps its feed`);
    }
    await proxied.release();
    assert.equal(proxied.worker, null, `${c.name}: release ends the Worker`);
    const feeds = readTensors(c, c.requests[0].inputs);
    const again = await proxied.run(feeds);
    const want = await local.run(feeds);
    for (const name of Object.keys(want)) assert.deepEqual(bytesOf(again[name]), bytesOf(want[name]), `${c.name} ${name}: after release`);
    await Promise.all([proxied.release(), local.release()]);
  }
});

test("a proxied session refuses what the in-thread one refuses, in one line, and keeps serving", { skip: SKIP || (!plain.length && "no cases") }, async () => {
  const [c] = plain;
  await refuses(() => InferenceSession.create(c.dag, { proxy: "yes" }), /^proxy must be true or false \(got "yes"\)$/);
  await refuses(() => InferenceSession.create(c.dag, { proxy: true, onnxruntime: {} }), /^proxy: the session runs in a Worker, which imports onnxruntime-web/);
  await refuses(() => InferenceSession.create(c.dag, { proxy: true, policy: "fast" }), /^unknown policy 'fast'/);
  await refuses(() => InferenceSession.create(`${c.dag}.missing`, { proxy: true }), /^cannot read .*dag\.json\.missing/);
  await refuses(() => InferenceSession.create(c.dag, { proxy: true, onProgress: () => { throw new Error("stop"); } }),
    /^onProgress threw: stop$/);
  const session = await InferenceSession.create(c.dag, { proxy: true });
  const feeds = readTensors(c, c.requests[0].inputs);
  const [name] = session.inputNames;
  await refuses(() => session.run({ ...feeds, nope: feeds[name] }), /^unknown input 'nope': the model's inputs are '/);
  await refuses(() => session.run({ ...feeds, [name]: undefined }), /^missing input '/);
  await refuses(() => session.run(feeds, ["nope"]), /^unknown output 'nope'/);
  await refuses(() => session.run(null), /^feeds must be an object/);
  await refuses(() => session.run({ ...feeds, [name]: { type: "float32", data: () => 0, dims: [1] } }),
    /the request cannot be sent to the session's Worker/);
  const outputs = await session.run(feeds);
  assert.deepEqual(Object.keys(outputs), session.outputNames);
  await session.release();
});

for (const c of generating.slice(0, 1)) {
  test(`${c.name}: a proxied generate streams the in-thread ids and logits, and a throwing onToken stops it`, async () => {
    const local = await InferenceSession.create(c.dag);
    const proxied = await InferenceSession.create(c.dag, { proxy: true });
    const run = async (/** @type {any} */ session) => {
      const streamed = [], logits = [];
      const ids = await session.generate(c.generate.prompt, { maxNewTokens: c.generate.ids.length,
        onLogits: (/** @type {Float32Array} */ row) => logits.push(Array.from(row)),
        onToken: async (/** @type {number} */ id) => { streamed.push(id); } });
      assert.deepEqual(streamed, ids);
      return { ids, logits };
    };
    const [got, want] = [await run(proxied), await run(local)];
    assert.deepEqual(got, want);
    assert.deepEqual(proxied.lastGeneration.steps, local.lastGeneration.steps);
    await assert.rejects(() => proxied.generate(c.generate.prompt, { maxNewTokens: 3, onToken: () => { throw new Error("enough"); } }),
      /enough/);
    assert.deepEqual(await proxied.generate(c.generate.prompt, { maxNewTokens: 2 }), want.ids.slice(0, 2), "still generating");
    await Promise.all([proxied.release(), local.release()]);
  });
}
