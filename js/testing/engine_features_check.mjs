// Runs a dag.json once on the JavaScript runtime for tests/test_js_engines.py, to show which of a
// CU's modules (the primary or an alternate built for other features) the engine picked:
//   node [--experimental-wasm-relaxed-simd] js/testing/engine_features_check.mjs JOB.json
// JOB: {"dag", "folder", "inputs": {NAME: {dtype, shape, file}}, "out"}
// Writes each output to OUT/NAME.bin and prints one JSON line: {"trace": lastTrace, "error": null},
// or {"trace": null, "error": message} when the session refuses the dag (a CortexError).
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";
import { CortexError, InferenceSession } from "../src/index.js";
import { readTensors } from "./cases.js";

const job = JSON.parse(readFileSync(process.argv[2], "utf8"));
const feeds = readTensors(job, job.inputs);
let report;
try {
  const session = await InferenceSession.create(job.dag, { policy: "strict" });
  for (const [name, tensor] of Object.entries(await session.run(feeds))) {
    const { buffer, byteOffset, byteLength } = tensor.data;
    writeFileSync(path.join(job.out, `${name}.bin`), new Uint8Array(buffer, byteOffset, byteLength));
  }
  report = { trace: session.lastTrace, error: null };
  await session.release();
} catch (e) {
  if (!(e instanceof CortexError)) throw e;
  report = { trace: null, error: e.message };
}
console.log(JSON.stringify(report));
