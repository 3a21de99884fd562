// MatMulNBits CUs (4- and 8-bit codes the wasm kernels read as stored) on dag.json files the Python
// side compiled (tests/test_js_nbits.py): each accuracy level gives onnxruntime's outputs within its
// own bound per output (level 4: 1e-6 of the output's largest value; 0 to 3: float32 rounding of
// sum |a w|), each CU's memory is the size the Python runtime reports for it, and a 4-bit CU holds
// at most `max_ratio` of the bytes of the same product built as a float32 MatMul.
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { InferenceSession } from "../src/index.js";
import { assertClose, loadCases, readTensors } from "../testing/cases.js";

const cases = loadCases().filter((c) => c.nbits);

/** The outputs of one strict run of `dag` on the case's first request, and its trace. @param {any} c @param {string} dag */
async function strictRun(c, dag) {
  const session = await InferenceSession.create(dag, { policy: "strict" });
  const got = await session.run(readTensors(c, c.requests[0].inputs));
  return { got, trace: session.lastTrace };
}

/** @param {any} trace */
const residentBytes = (trace) => trace.cus.reduce((/** @type {number} */ n, /** @type {any} */ t) => n + t.resident_bytes, 0);

for (const c of cases) {
  test(`${c.name}: onnxruntime's outputs within the accuracy level's bound, each CU holding the Python runtime's bytes`,
    async () => {
      const { got, trace } = await strictRun(c, c.dag);
      const want = readTensors(c, c.requests[0].outputs);
      assert.deepEqual(Object.keys(got).sort(), Object.keys(want).sort());
      for (const name of Object.keys(want)) {
        assertClose(got[name], want[name], 0, c.nbits.atol[name], `${c.name} (accuracy level ${c.nbits.accuracy_level}) ${name}`);
      }
      assert.ok(trace.cus.some((/** @type {any} */ t) => t.op_types.includes("MatMulNBits")), "a CU runs MatMulNBits");
      assert.deepEqual(Object.fromEntries(trace.cus.map((/** @type {any} */ t) => [t.cu, t.resident_bytes])),
        c.nbits.resident_bytes);
      if (process.env.CORTEX_JS_TRACES) writeFileSync(path.join(process.env.CORTEX_JS_TRACES, `${c.name}-nbits.json`), JSON.stringify(trace));
    });

  if (!c.nbits.float_dag) continue;
  test(`${c.name}: the 4-bit CU holds at most ${c.nbits.max_ratio}x the bytes of its float32 twin's`, async () => {
    const narrow = (await strictRun(c, c.dag)).trace;
    const float = (await strictRun(c, path.join(c.folder, c.nbits.float_dag))).trace;
    const ratio = residentBytes(narrow) / residentBytes(float);
    assert.ok(ratio <= c.nbits.max_ratio, `resident bytes ${residentBytes(narrow)} against ${residentBytes(float)}: ${ratio}`);
    // The session's peak adds the live tensors (a row in, a row out) to the resident CUs.
    const peak = narrow.sandbox_stats.peak_memory_mb / float.sandbox_stats.peak_memory_mb;
    assert.ok(peak <= c.nbits.max_ratio, `peak memory ${peak}`);
  });
}
