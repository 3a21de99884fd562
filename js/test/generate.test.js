// Token generation (js/src/generate.js) on language models the Python side built per (new tokens,
// cache bucket) specialization (tests/test_js_generate.py): greedy ids and each token's logits
// against onnxruntime's greedy loop, the cache growing to a larger bucket mid-generation against
// one large bucket, seeded sampling, and the one-line refusals.
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { CortexError, InferenceSession } from "../src/index.js";
import { assertClose, loadCases, readTensors } from "../testing/cases.js";
import { Tensor } from "../src/tensor.js";

const cases = loadCases().filter((c) => c.generate);

/** @param {() => Promise<unknown>} action @param {RegExp} message */
async function refuses(action, message) {
  await assert.rejects(action, (e) => (e instanceof CortexError && message.test(e.message) && !e.message.includes("\n"))
    || assert.fail(`${e?.name}: ${e?.message} does not match ${message}`));
}

/** The ids `session` makes after the case's prompt, with the logits of each. @param {any} session @param {any} c @param {object} [options] */
async function greedy(session, c, options = {}) {
  /** @type {Float32Array[]} */
  const logits = [];
  /** @type {number[]} */
  const streamed = [];
  const ids = await session.generate(c.generate.prompt, { maxNewTokens: c.generate.ids.length,
    onLogits: (/** @type {Float32Array} */ row) => logits.push(row), onToken: (/** @type {number} */ id, /** @type {number} */ i) => {
      assert.equal(i, streamed.length);
      streamed.push(id);
    }, ...options });
  assert.deepEqual(streamed, ids, "onToken saw each id as it was made");
  return { ids, logits };
}

/** Whether the run moved to a larger bucket. @param {any} record */
const grew = (record) => new Set(record.steps.map((/** @type {any} */ s) => s.bucket)).size > 1;

for (const c of cases.filter((c) => c.generate.ids)) {
  test(`${c.name}: greedy ids and logits are onnxruntime's`, async () => {
    const session = await InferenceSession.create(c.dag, { policy: "strict" });
    const { ids, logits } = await greedy(session, c);
    assert.deepEqual(ids, c.generate.ids);
    const want = readTensors(c, c.requests[0].outputs).logits;
    const got = new Float32Array(want.data.length);
    logits.forEach((row, i) => got.set(row, i * row.length));
    assertClose(new Tensor("float32", got, want.dims), want, 0, c.generate.atol, `${c.name} logits`);
    const record = session.lastGeneration;
    assert.equal(record.steps.reduce((/** @type {number} */ n, /** @type {any} */ s) => n + s.tokens, 0),
      c.generate.prompt.length + ids.length - 1, "every token but the last went through the cache once");
    assert.equal(record.decode_ms.length, ids.length - 1);
    if (c.generate.grows) assert.ok(grew(record), JSON.stringify(record.steps));
    if (process.env.CORTEX_JS_TRACES) writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-generate.json`), JSON.stringify(session.lastTrace));
  });
}

for (const c of cases.filter((c) => c.generate.twin)) {
  test(`${c.name}: growing the cache mid-generation gives the ids of one large bucket`, async () => {
    const growing = await InferenceSession.create(c.dag);
    const { ids } = await greedy(growing, c);
    assert.ok(grew(growing.lastGeneration), JSON.stringify(growing.lastGeneration.steps));
    const large = await InferenceSession.create(path.resolve(c.folder, c.generate.twin));
    const once = await greedy(large, c);
    const prefill = large.lastGeneration.steps.slice(0, c.generate.twin_steps.length).map((/** @type {any} */ s) => [s.tokens, s.bucket]);
    assert.deepEqual(prefill, c.generate.twin_steps, "the prompt went in by the largest chunks first");
    assert.ok(!grew(large.lastGeneration));
    assert.deepEqual(once.ids, ids);
    assert.deepEqual(ids, c.generate.ids);
  });
}

for (const c of cases.filter((c) => c.generate.sampling)) {
  test(`${c.name}: seeded sampling repeats, and top-k 1 is greedy`, async () => {
    const session = await InferenceSession.create(c.dag);
    const sampling = { temperature: 1.5, topK: 64, topP: 0.95 };
    const first = (await greedy(session, c, { ...sampling, seed: 7 })).ids;
    const again = (await greedy(session, c, { ...sampling, seed: 7 })).ids;
    const other = (await greedy(session, c, { ...sampling, seed: 8 })).ids;
    assert.deepEqual(again, first);
    assert.notDeepEqual(other, first, "another seed draws other tokens");
    assert.notDeepEqual(first, c.generate.ids, "sampling at temperature 1.5 is not greedy");
    assert.deepEqual((await greedy(session, c, { ...sampling, topK: 1, seed: 7 })).ids, c.generate.ids);
    const stop = first[3];
    const stopped = (await greedy(session, c, { ...sampling, seed: 7, stopIds: [stop] })).ids;
    assert.deepEqual(stopped, first.slice(0, first.indexOf(stop) + 1), "the stop id is emitted, then generation ends");
    if (process.env.CORTEX_JS_TRACES) writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-sampled.json`), JSON.stringify(session.lastTrace));
  });
}

for (const c of cases.filter((c) => c.generate.errors)) {
  test(`${c.name}: a bad prompt or option is refused in one line`, async () => {
    const session = await InferenceSession.create(c.dag);
    const largest = Math.max(...session.sections.map((s) => s.input_shapes["past_key_values.0.key"][2]));
    await refuses(() => session.generate(new Array(largest + 1).fill(3)),
      new RegExp(`^the prompt has ${largest + 1} tokens; the largest cache the model was compiled for holds ${largest}$`));
    await refuses(() => session.generate([5, 256, 7]), /^token id 256 \(at 1\) is outside the vocabulary of 256$/);
    await refuses(() => session.generate([5, -1]), /^token id -1 \(at 1\) is outside the vocabulary of 256$/);
    await refuses(() => session.generate([]), /^the prompt is empty/);
    await refuses(() => session.generate([1, 2], { maxNewTokens: largest }),
      new RegExp(`^a prompt of 2 tokens and maxNewTokens ${largest} need a cache of ${largest + 1} positions; the largest `));
    await refuses(() => session.generate([1, 2], { temperature: -1 }), /^temperature must be a number, at least 0/);
    await refuses(() => session.generate([1, 2], { topP: 0 }), /^topP must be in \(0, 1\]/);
    assert.equal((await session.generate([1, 2], { maxNewTokens: 2 })).length, 2, "still generating");
  });
}

for (const c of cases.filter((c) => c.generate.not_language_model)) {
  test(`${c.name}: a model without a key/value cache is refused in one line`, async () => {
    const session = await InferenceSession.create(c.dag);
    await refuses(() => session.generate([1, 2, 3]), /dag\.json: not a language model with a key\/value cache \(generation needs inputs input_ids, attention_mask and past key\/values; it has '/);
    const outputs = await session.run(Object.fromEntries(session.inputMetadata.map((s) => [s.name,
      new Tensor("float32", new Float32Array(s.shape.reduce((n, d) => n * d, 1)), s.shape)])));
    assert.ok(Object.keys(outputs).length > 0, "still serving");
    if (process.env.CORTEX_JS_TRACES) writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-run.json`), JSON.stringify(session.lastTrace));
  });
}
