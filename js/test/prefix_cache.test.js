// The prefix cache of `session.generate` (js/src/prefix_cache.js) on a language model the Python
// side built per (new tokens, cache bucket) specialization (tests/test_js_generate.py): a prompt
// sharing whole chunks with an earlier one restores them, runs only the rest and gives bitwise the
// logits of a session without the cache (and onnxruntime's ids); the bound evicts the least
// recently used chunk.
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { CortexError, InferenceSession } from "../src/index.js";
import { assertClose, loadCases, readTensors } from "../testing/cases.js";
import { Tensor } from "../src/tensor.js";

const cases = loadCases().filter((c) => c.generate?.prefix);

/** The case's ids and each one's logits, made by `session`. @param {any} session @param {any} c @param {object} [options] */
async function generated(session, c, options = {}) {
  /** @type {Float32Array[]} */
  const logits = [];
  const ids = await session.generate(c.generate.prompt, { maxNewTokens: c.generate.ids.length,
    onLogits: (/** @type {Float32Array} */ row) => logits.push(row), ...options });
  return { ids, logits };
}

/** The last generation's prompt steps as [tokens, bucket]. @param {any} record */
const prefill = (record) => record.steps.slice(0, record.steps.length - record.decode_ms.length)
  .map((/** @type {any} */ s) => [s.tokens, s.bucket]);

/** @param {any} stats @param {string[]} names */
const some = (stats, ...names) => Object.fromEntries(names.map((n) => [n, stats[n]]));

for (const c of cases) {
  test(`${c.name}: a shared prefix is restored and gives bitwise the logits of a run without the cache`, async () => {
    const { warm, chunk, bucket } = c.generate.prefix;
    const session = await InferenceSession.create(c.dag, { policy: "strict" });
    await session.generate(warm, { maxNewTokens: 1 });
    assert.equal(session.lastGeneration.prefixHitTokens, 0);
    assert.deepEqual(some(session.lastGeneration.prefixCache, "entries", "hits", "misses", "evictions"),
      { entries: 2, hits: 0, misses: 1, evictions: 0 }, "the first prompt left its two whole chunks");
    const hit = await generated(session, c);
    const record = session.lastGeneration;
    assert.equal(record.prefixHitTokens, 2 * chunk);
    assert.deepEqual(prefill(record), [[chunk, bucket], [1, bucket]], "only the rest of the prompt ran");
    assert.deepEqual(some(record.prefixCache, "entries", "hits"), { entries: 3, hits: 2 });

    const off = await InferenceSession.create(c.dag, { policy: "strict", prefixCacheMB: 0 });
    const cold = await generated(off, c);
    assert.equal(off.lastGeneration.prefixHitTokens, 0);
    assert.deepEqual(prefill(off.lastGeneration), [[chunk, bucket], [chunk, bucket], [chunk, bucket], [1, bucket]]);
    assert.equal(off.lastGeneration.prefixCache.entries, 0);
    assert.deepEqual(hit.ids, c.generate.ids);
    assert.deepEqual(cold.ids, c.generate.ids);
    assert.equal(hit.logits.length, cold.logits.length);
    hit.logits.forEach((row, i) => assert.ok(Buffer.from(row.buffer).equals(Buffer.from(cold.logits[i].buffer)),
      `token ${i}: the logits after a hit are bitwise those without the cache`));
    const want = readTensors(c, c.requests[0].outputs).logits;
    const got = new Float32Array(want.data.length);
    hit.logits.forEach((row, i) => got.set(row, i * row.length));
    assertClose(new Tensor("float32", got, want.dims), want, 0, c.generate.atol, `${c.name} logits`);

    await off.generate(warm, { maxNewTokens: 1, prefixCacheMB: 1 });
    await generated(off, c);
    assert.equal(off.lastGeneration.prefixHitTokens, 2 * chunk, "generate's prefixCacheMB turned the cache on");
    assert.equal(off.lastGeneration.prefixCache.maxBytes, 2 ** 20);
    if (process.env.CORTEX_JS_TRACES) writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-prefix.json`), JSON.stringify(session.lastTrace));
  });

  test(`${c.name}: the prefix cache's bound evicts the least recently used chunk`, async () => {
    const { warm, chunk } = c.generate.prefix;
    const session = await InferenceSession.create(c.dag);
    const chunkBytes = Object.entries(session.sections[0].input_shapes).filter(([name]) => name.startsWith("past_key_values."))
      .reduce((n, [, [, heads, , width]]) => n + heads * chunk * width * 4, 0);
    const bound = { prefixCacheMB: 3.5 * chunkBytes / 2 ** 20 };      // three chunks fit
    const other = (/** @type {number} */ shift) => warm.slice(0, chunk + 1).map((/** @type {number} */ id) => (id + shift) % 256);
    const run = async (/** @type {number[]} */ ids) => {
      await session.generate(ids, { maxNewTokens: 1 });
      return session.lastGeneration;
    };
    await session.generate(warm, { maxNewTokens: 1, ...bound });     // its chunks 0 and 1
    await run(other(1));                                // a chunk of another prompt: the cache is full
    assert.equal((await run(warm)).prefixHitTokens, 2 * chunk, "the first prompt's chunks are now the most recently used");
    const full = (await run(other(2))).prefixCache;     // one more chunk: the other prompt's goes
    assert.deepEqual(some(full, "entries", "bytes", "evictions"), { entries: 3, bytes: 3 * chunkBytes, evictions: 1 });
    assert.ok(full.bytes <= full.maxBytes);
    assert.equal((await run(warm)).prefixHitTokens, 2 * chunk, "the recently used chunks stayed");
    assert.equal((await run(other(1))).prefixHitTokens, 0, "the least recently used chunk was evicted");
    await assert.rejects(session.generate(warm, { prefixCacheMB: -1 }),
      (/** @type {any} */ e) => e instanceof CortexError && /^prefixCacheMB must be a number of megabytes, at least 0 \(got -1\)$/.test(e.message));
    await assert.rejects(InferenceSession.create(c.dag, { prefixCacheMB: "a lot" }), /^CortexError: prefixCacheMB must be/);
  });
}
