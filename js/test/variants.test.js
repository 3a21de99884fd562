// Reduced-precision variants and the offline policy, on a dag.json the Python side compiled with
// --variants and calibrated (tests/test_js_variants.py): for each policy and trust threshold the
// same CUs run the same variants as in the Python runtime, with its outputs, and a guard that
// fires there fires here with the same reason; offline runs the source model on onnxruntime-web.
import assert from "node:assert/strict";
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { test } from "node:test";
import { CortexError, InferenceSession } from "../src/index.js";
import { formatG } from "../src/variants.js";
import { assertClose, loadCases, onnxruntimeWeb, readTensors } from "../testing/cases.js";

const cases = loadCases().filter((c) => c.variant_runs);
const ort = await onnxruntimeWeb();
const noOrt = !ort && "the offline policy needs onnxruntime-web (CORTEX_JS_ORTWEB)";

/** @param {() => Promise<unknown>} action @param {RegExp} message */
async function refuses(action, message) {
  await assert.rejects(action, (e) => e instanceof CortexError && message.test(e.message)
    || assert.fail(`${e?.name}: ${e?.message} does not match ${message}`));
}

/** A copy of a case's folder that a test may break. @param {any} c */
function copiedFolder(c) {
  const folder = mkdtempSync(path.join(tmpdir(), "cortex-js-variants-"));
  cpSync(c.folder, folder, { recursive: true });
  return { folder, dag: path.join(folder, path.relative(c.folder, c.dag)), done: () => rmSync(folder, { recursive: true }) };
}

/** @param {any[]} entries */
const byCu = (entries) => [...entries].sort((a, b) => (a.cu < b.cu ? -1 : 1));

test("formatG writes numbers as Python's format(x, '.6g') does", () => {
  const cases = [[0, "0"], [1, "1"], [-5.5176, "-5.5176"], [123456789, "1.23457e+08"], [0.0001234567, "0.000123457"],
    [0.00001234567, "1.23457e-05"], [999999.5, "1e+06"], [100000, "100000"], [3.8192737102508545, "3.81927"]];
  for (const [x, want] of cases) assert.equal(formatG(/** @type {number} */ (x), 6), want);
  assert.equal(formatG(2.7500001, 3), "2.75");
});

for (const c of cases) {
  for (const [k, runSpec] of c.variant_runs.entries()) {
    const label = `${runSpec.policy}${runSpec.trust_threshold === undefined ? "" : ` at trust ${runSpec.trust_threshold}`}`;
    test(`${c.name} (${runSpec.name}) under ${label}: the Python runtime's variant picks, guards and outputs`, async () => {
      const dag = path.join(c.folder, runSpec.dag);
      const session = await InferenceSession.create(dag, { policy: runSpec.policy, trustThreshold: runSpec.trust_threshold });
      for (const [i, request] of runSpec.requests.entries()) {
        const got = await session.run(readTensors(c, request.inputs));
        const want = readTensors(c, request.outputs);
        for (const name of Object.keys(want)) assertClose(got[name], want[name], c.rtol, c.atol, `run ${k} request ${i} ${name}`);
        const trace = session.lastTrace;
        assert.deepEqual(byCu(trace.approximated_cus), byCu(runSpec.approximated[i]), `run ${k} request ${i}: approximated`);
        assert.deepEqual(byCu(trace.fell_back_cus), byCu(runSpec.fell_back[i]), `run ${k} request ${i}: fell back`);
        for (const entry of trace.cus) {
          const picked = runSpec.approximated[i].find((/** @type {any} */ a) => a.cu === entry.cu);
          assert.equal(entry.precision, picked?.precision, `${entry.cu}: the trace's entry names its variant`);
        }
        if (process.env.CORTEX_JS_TRACES) {
          writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-variants-${k}-${i}.json`), JSON.stringify(trace));
        }
      }
    });
  }

  test(`${c.name}: a variant runs again on repeated inputs, and so do the exact CUs of a dag.json that marks none repeating`, async () => {
    const session = await InferenceSession.create(c.dag);
    const request = c.variant_runs[0].requests[0];
    const feeds = readTensors(c, request.inputs);
    const first = await session.run(feeds);
    const approximated = session.lastTrace.approximated_cus.map((/** @type {any} */ a) => a.cu);
    assert.ok(approximated.length > 0);
    await session.run(feeds);
    const trace = session.lastTrace;
    assert.deepEqual(trace.approximated_cus.map((/** @type {any} */ a) => a.cu), approximated, "variants run again");
    // Only CUs dag.json marks repeating (and those chained from them) are keyed; a variant never is.
    assert.ok(session.dag.cus.every((cu) => cu.cache === undefined));
    assert.deepEqual(trace.skipped_cus, []);
    assert.deepEqual(trace.activated_cus, session.dag.order);
    const again = await session.run(feeds, { policy: "strict" });
    assert.deepEqual(session.lastTrace.approximated_cus, []);
    assert.notDeepEqual(again.y.data, first.y.data, "strict runs the exact CUs, whose bits differ");
    await session.run(feeds, { trustThreshold: null });           // balanced's skips and cache, exact CUs only
    assert.deepEqual([session.lastTrace.policy, session.lastTrace.approximated_cus], ["balanced", []]);
  });

  test(`${c.name}: a variant module that was tampered with is refused when a policy first picks it`, async () => {
    const copy = copiedFolder(c);
    try {
      const dag = JSON.parse(readFileSync(copy.dag, "utf8"));
      const cu = dag.cus.find((/** @type {any} */ x) => x.variants?.int8);
      const file = path.join(path.dirname(copy.dag), cu.variants.int8.artifacts.wasm.path);
      const bytes = readFileSync(file);
      bytes[bytes.length - 1] ^= 1;
      writeFileSync(file, bytes);
      // Without the module cache: modules compiled from verified bytes earlier in this process would be
      // served by their sha256, the changed file unread.
      const session = await InferenceSession.create(copy.dag, { policy: "strict", moduleCache: false });   // strict picks none
      const feeds = readTensors(c, c.variant_runs[0].requests[0].inputs);
      await session.run(feeds);
      const message = new RegExp(`${path.basename(file)}: sha256 [0-9a-f]{64} is not the ${cu.variants.int8.artifacts.wasm.sha256} `
        + `that dag.json records for ${cu.id}-int8`);
      await refuses(() => session.run(feeds, { policy: "balanced" }), message);
      await refuses(() => InferenceSession.create(copy.dag, { moduleCache: false }), message);
      assert.ok(await session.run(feeds, { policy: "strict" }), "the session still serves");
      await refuses(() => session.run(feeds, { trustThreshold: 2 }), /^trustThreshold must be in \[0, 1\] \(got 2\)$/);
    } finally {
      copy.done();
    }
  });

  test(`${c.name} under offline: the source model on onnxruntime-web gives onnxruntime's outputs`, { skip: noOrt }, async () => {
    const session = await InferenceSession.create(c.dag, { policy: "offline", onnxruntime: ort });
    for (const [i, request] of c.offline.requests.entries()) {
      const got = await session.run(readTensors(c, request.inputs));
      const want = readTensors(c, request.outputs);
      for (const name of Object.keys(want)) assertClose(got[name], want[name], c.rtol, c.atol, `offline request ${i} ${name}`);
      const trace = session.lastTrace;
      assert.equal(trace.policy, "offline");
      assert.deepEqual([trace.activated_cus, trace.cus, trace.cache], [[], [], null]);
      assert.deepEqual({ ...trace.offline, seconds: 0 }, { model: c.offline.model, sha256: c.offline.sha256, runtime: "onnxruntime", seconds: 0 });
      assert.equal(trace.sandbox_stats.peak_memory_basis, "process maxrss");
      if (process.env.CORTEX_JS_TRACES) writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-offline-${i}.json`), JSON.stringify(trace));
    }
    const strict = await InferenceSession.create(c.dag, { policy: "strict", onnxruntime: ort });
    const request = c.offline.requests[0];
    const got = await strict.run(readTensors(c, request.inputs), { policy: "offline" });   // per request
    assertClose(got.y, readTensors(c, request.outputs).y, c.rtol, c.atol, "offline per request");
    assert.equal(strict.lastTrace.policy, "offline");
  });

  test(`${c.name} under offline: no module is read, so a broken one does not stop it`, { skip: noOrt }, async () => {
    const copy = copiedFolder(c);
    try {
      const dag = JSON.parse(readFileSync(copy.dag, "utf8"));
      const module = path.join(path.dirname(copy.dag), dag.cus[0].artifacts.wasm.path);
      rmSync(module);
      const session = await InferenceSession.create(copy.dag, { policy: "offline", onnxruntime: ort, moduleCache: false });
      const feeds = readTensors(c, c.offline.requests[0].inputs);
      await session.run(feeds);
      await refuses(() => session.run(feeds, { policy: "strict" }), new RegExp(`cannot read ${module}: ENOENT`));
    } finally {
      copy.done();
    }
  });

  test(`${c.name}: offline without a source model, with a changed one or without onnxruntime-web is one error`, async () => {
    const copy = copiedFolder(c);
    try {
      const dag = JSON.parse(readFileSync(copy.dag, "utf8"));
      let onnxruntimeImports = true;
      await import("onnxruntime-web").catch(() => { onnxruntimeImports = false; });
      if (!onnxruntimeImports) {
        await refuses(() => InferenceSession.create(copy.dag, { policy: "offline" }),
          /^the offline policy runs the source model on onnxruntime-web: install it, or pass it as InferenceSession\.create/);
      }
      if (!ort) return;
      const source = path.join(path.dirname(copy.dag), dag.source_model.path);
      writeFileSync(source, Buffer.concat([readFileSync(source), Buffer.from([0])]));
      await refuses(() => InferenceSession.create(copy.dag, { policy: "offline", onnxruntime: ort }),
        /model\.onnx: the source model changed since build-dag \(its sha256 differs from file:.*dag\.json's\); run 'cortex build-dag'/);
      rmSync(source);
      await refuses(() => InferenceSession.create(copy.dag, { policy: "offline", onnxruntime: ort }),
        /model\.onnx: the source model dag\.json records is missing; run 'cortex build-dag'/);
      const { source_model: _, ...without } = dag;
      writeFileSync(copy.dag, JSON.stringify(without));
      await refuses(() => InferenceSession.create(copy.dag, { policy: "offline", onnxruntime: ort }),
        /dag\.json: records no source model, so the offline policy cannot run; .*cortex bundle --with-source/);
      const session = await InferenceSession.create(copy.dag, { onnxruntime: ort });
      const feeds = readTensors(c, c.offline.requests[0].inputs);
      await refuses(() => session.run(feeds, { policy: "offline" }), /records no source model/);
      assert.ok(await session.run(feeds), "the session still serves");
    } finally {
      copy.done();
    }
  });
}
