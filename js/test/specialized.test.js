// Shape specializations (cortex.dag/2) and external weights: each compiled shape runs on its own
// section, another shape is refused in one line listing the compiled ones (the Python runtime's
// words), padding to a bucket gives the Python runtime's outputs, and a weight file whose bytes
// changed is refused when the session is created. Under the offline policy every compiled shape runs
// the one source model on onnxruntime-web and gives onnxruntime's outputs.
import assert from "node:assert/strict";
import { cpSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { test } from "node:test";
import { pathToFileURL } from "node:url";
import { CortexError, InferenceSession } from "../src/index.js";
import { assertClose, loadCases, onnxruntimeWeb, readTensors } from "../testing/cases.js";

const cases = loadCases();
const ort = await onnxruntimeWeb();
const specialized = cases.filter((c) => c.specialized);
const external = cases.filter((c) => c.external_weights);
// Without such cases (CORTEX_JS_CASES unset, or other cases only) these tests are not defined;
// tests/test_js_node.py checks that each one it expects passed.

/** @param {() => Promise<unknown> | unknown} action @param {RegExp} message */
async function refuses(action, message) {
  await assert.rejects(async () => action(), (e) => e instanceof CortexError && message.test(e.message)
    || assert.fail(`${e?.name}: ${e?.message} does not match ${message}`));
}

/** @param {string} text */
const literal = (text) => text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

for (const c of specialized) {
  test(`${c.name}: each compiled shape runs on its specialization`, async () => {
    const session = await InferenceSession.create(c.dag);
    const dag = JSON.parse(readFileSync(c.dag, "utf8"));
    assert.equal(dag.schema, "cortex.dag/2");
    assert.deepEqual(session.inputMetadata.map((s) => s.shape), Object.values(dag.specializations[0].input_shapes));
    for (const request of c.requests) {
      const feeds = readTensors(c, request.inputs);
      const got = await session.run(feeds);
      const want = readTensors(c, request.outputs);
      for (const name of Object.keys(want)) assertClose(got[name], want[name], c.rtol, c.atol, `${c.name} ${name}`);
      const section = dag.specializations.find((/** @type {any} */ s) => Object.entries(s.input_shapes)
        .every(([n, shape]) => JSON.stringify(shape) === JSON.stringify([...feeds[n].dims])));
      assert.equal(session.specialization, section.name);
      assert.deepEqual(session.lastTrace.activated_cus.length > 0, true);
    }
  });

  test(`${c.name} under offline: each compiled shape runs the source model and gives onnxruntime's outputs`,
    { skip: !ort && "the offline policy needs onnxruntime-web (CORTEX_JS_ORTWEB)" }, async () => {
      const dag = JSON.parse(readFileSync(c.dag, "utf8"));
      const session = await InferenceSession.create(c.dag, { policy: "offline", onnxruntime: ort });
      const names = new Set();
      for (const [i, request] of [...c.requests].reverse().entries()) {     // not the first section first
        const feeds = readTensors(c, request.inputs);
        const got = await session.run(feeds);
        const want = readTensors(c, request.outputs);
        for (const name of Object.keys(want)) assertClose(got[name], want[name], c.rtol, c.atol, `${c.name} offline ${name}`);
        const section = dag.specializations.find((/** @type {any} */ s) => Object.entries(s.input_shapes)
          .every(([n, shape]) => JSON.stringify(shape) === JSON.stringify([...feeds[n].dims])));
        assert.equal(session.specialization, section.name);
        names.add(section.name);
        const trace = session.lastTrace;
        assert.deepEqual([trace.policy, trace.activated_cus, trace.cus], ["offline", [], []]);
        assert.deepEqual([trace.offline.model, trace.offline.sha256], [dag.source_model.path, dag.source_model.sha256]);
        if (process.env.CORTEX_JS_TRACES) writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-offline-${i}.json`), JSON.stringify(trace));
      }
      assert.equal(names.size, dag.specializations.length, "every specialization was asked for");
      assert.deepEqual(session.schedulers.filter((s) => s !== undefined), [], "offline instantiates no CU");
      const strict = await InferenceSession.create(c.dag, { policy: "strict", onnxruntime: ort });
      const last = c.requests[c.requests.length - 1];
      const got = await strict.run(readTensors(c, last.inputs), { policy: "offline" });     // per request
      const want = readTensors(c, last.outputs);
      for (const name of Object.keys(want)) assertClose(got[name], want[name], c.rtol, c.atol, `${c.name} offline per request ${name}`);
      assert.equal(strict.lastTrace.policy, "offline");
    });

  test(`${c.name} under offline: a frozen input or another source model in any section is refused in one line`, async () => {
    const folder = mkdtempSync(path.join(tmpdir(), "cortex-js-"));
    try {
      const dag = JSON.parse(readFileSync(c.dag, "utf8"));
      const last = dag.specializations[dag.specializations.length - 1];
      const write = (/** @type {any} */ document) => {
        const file = path.join(folder, "dag.json");
        writeFileSync(file, JSON.stringify(document));
        return file;
      };
      const input = dag.specializations[0].inputs[0].name;
      const frozen = { ...dag, specializations: dag.specializations.map((/** @type {any} */ s) => (s === last
        ? { ...s, options: { ...s.options, frozen_inputs: [{ name: input }] } } : s)) };
      await refuses(() => InferenceSession.create(write(frozen), { policy: "offline", onnxruntime: ort ?? {} }),
        new RegExp(`dag.json: the CUs were built with --freeze-input ${literal(input)}; the source model still takes those inputs`));
      const other = { ...dag, specializations: dag.specializations.map((/** @type {any} */ s) => (s === last
        ? { ...s, source_model: { path: "other.onnx", sha256: "0".repeat(64) } } : s)) };
      await refuses(() => InferenceSession.create(write(other), { policy: "offline", onnxruntime: ort ?? {} }),
        new RegExp(`dag.json: specialization ${literal(last.name)} records another source model \\("other.onnx"\\)`));
    } finally {
      rmSync(folder, { recursive: true });
    }
  });

  test(`${c.name}: a shape no specialization holds is refused in one line naming the compiled ones`, async () => {
    const session = await InferenceSession.create(c.dag);
    const feeds = readTensors(c, c.specialized.refused);
    const href = pathToFileURL(c.dag).href;
    await refuses(() => session.run(feeds), new RegExp(`^no shape specialization matches the inputs `
      + `\\(${literal(c.specialized.refused_text)}\\); ${literal(href)} was compiled for: ${literal(c.specialized.compiled_for)}$`));
    assert.ok(!c.specialized.compiled_for.includes("\n"));
    if (c.specialized.pad) {
      const padded = await InferenceSession.create(c.dag, { padToBucket: c.specialized.pad.bucket });
      await refuses(() => padded.run(feeds), new RegExp(`^no shape specialization matches or holds the inputs padded along `
        + `${c.specialized.pad.bucket} \\(${literal(c.specialized.refused_text)}\\); .* was compiled for: ${literal(c.specialized.compiled_for)}$`));
    }
    await refuses(() => InferenceSession.create(c.dag, { padToBucket: "nope" }), /^--pad-to-bucket nope: not a dim or input of the specializations \(they have /);
    const request = c.requests[0];
    const outputs = await session.run(readTensors(c, request.inputs));     // still serving
    assert.deepEqual(Object.keys(outputs), session.outputNames);
  });

  test(`${c.name}: padding to a bucket gives the Python runtime's outputs`, { skip: !c.specialized.pad && "no padded requests" }, async () => {
    const { bucket, value, requests } = c.specialized.pad;
    const session = await InferenceSession.create(c.dag, { padToBucket: bucket, padValue: value, policy: "strict" });
    for (const request of requests) {
      const got = await session.run(readTensors(c, request.inputs));
      assert.equal(session.specialization, request.specialization);
      const want = readTensors(c, request.outputs);
      for (const name of Object.keys(want)) assertClose(got[name], want[name], 0, 0, `${c.name} padded ${name}`);
    }
    const unpadded = await InferenceSession.create(c.dag);
    await refuses(() => unpadded.run(readTensors(c, requests[0].inputs)), /^no shape specialization matches the inputs/);
  });
}

for (const c of [...external, ...specialized]) {
  test(`${c.name}: a tampered weight file is refused at create, naming it and its CU`, async () => {
    const folder = mkdtempSync(path.join(tmpdir(), "cortex-js-"));
    try {
      const dagFolder = path.dirname(c.dag);
      cpSync(dagFolder, folder, { recursive: true });
      const dagPath = path.join(folder, path.basename(c.dag));
      const dag = JSON.parse(readFileSync(dagPath, "utf8"));
      const cus = dag.specializations ? dag.specializations.flatMap((/** @type {any} */ s) => s.cus) : dag.cus;
      const entry = cus.flatMap((/** @type {any} */ cu) => cu.artifacts.wasm.weights ?? [])[0];
      assert.ok(entry, "the build has weight files");
      const weightFolder = path.join(folder, path.dirname(entry.path));
      assert.equal(readdirSync(weightFolder).filter((f) => f.endsWith(".bin")).length, new Set(cus.flatMap((/** @type {any} */ cu) => (cu.artifacts.wasm.weights ?? [])
        .map((/** @type {any} */ w) => w.path))).size, "each weight file stored once");
      const file = path.join(folder, entry.path);
      const bytes = readFileSync(file);
      bytes[0] ^= 1;
      writeFileSync(file, bytes);
      await refuses(() => InferenceSession.create(dagPath), new RegExp(`${literal(path.basename(file))}: sha256 [0-9a-f]{64} \\(${entry.bytes} bytes\\) `
        + `is not the ${entry.sha256} \\(${entry.bytes} bytes\\) that dag.json records for the weights of cu-`));
    } finally {
      rmSync(folder, { recursive: true });
    }
  });
}

// Value specializations (`decompose --specialize sr=8000,16000`): one section per value of an input
// that decides an If, picked by the value each request gives; the input stays one the caller feeds.
for (const c of cases.filter((c) => c.value_specialized)) {
  test(`${c.name}: each compiled value runs on its specialization`, async () => {
    const session = await InferenceSession.create(c.dag);
    assert.deepEqual(session.inputMetadata.map((s) => [s.name, s.dtype, s.shape]), c.value_specialized.inputs);
    for (const [i, request] of c.requests.entries()) {
      const got = await session.run(readTensors(c, request.inputs));
      assert.equal(session.specialization, c.value_specialized.specializations[i]);
      const want = readTensors(c, request.outputs);
      for (const name of Object.keys(want)) assertClose(got[name], want[name], c.rtol, c.atol, `${c.name} ${name}`);
      if (process.env.CORTEX_JS_TRACES) writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-${i}.json`), JSON.stringify(session.lastTrace));
    }
  });

  test(`${c.name}: a value not compiled is refused in one line naming the compiled ones`, async () => {
    const session = await InferenceSession.create(c.dag);
    const href = pathToFileURL(c.dag).href;
    for (const refused of c.value_specialized.refused) {
      await refuses(() => session.run(readTensors(c, refused.inputs)), new RegExp(`^${literal(refused.message
        .replace("DAG", href))}$`));
    }
    const outputs = await session.run(readTensors(c, c.requests[0].inputs));     // still serving
    assert.deepEqual(Object.keys(outputs), session.outputNames);
  });
}
