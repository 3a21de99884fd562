// `make bench-js`'s memory figure in Node: one contestant per process (run with --expose-gc), its
// resident set (process.memoryUsage().rss, after a collection) before create, after the first run,
// after `session.release()`, and after the session is dropped too. Prints one JSON line.
//   node --expose-gc memory_node.mjs cortex|ortweb URL-or-path-of-dag.json-or-model.onnx inputs.json
import fs from "node:fs";
import * as ort from "onnxruntime-web";
import { InferenceSession, Tensor } from "../../js/src/index.js";

ort.env.wasm.numThreads = 1;
ort.env.logLevel = "error";
const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, uint8: Uint8Array, bool: Uint8Array };
const [kind, model, inputsFile] = process.argv.slice(2);

function feedsFrom(inputs, TensorType) {
  const feeds = {};
  for (const input of inputs) {
    const raw = fs.readFileSync(input.data);
    const data = new ARRAYS[input.dtype](raw.buffer, raw.byteOffset, raw.byteLength / ARRAYS[input.dtype].BYTES_PER_ELEMENT).slice();
    feeds[input.name] = new TensorType(input.dtype, data, input.shape);
  }
  return feeds;
}

async function rss() {
  for (let i = 0; i < 3; i++) {          // WeakRefs and finalizers need turns of the event loop
    globalThis.gc();
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return process.memoryUsage().rss;
}

const inputs = JSON.parse(fs.readFileSync(inputsFile, "utf8"));
let feeds = feedsFrom(inputs, kind === "cortex" ? Tensor : ort.Tensor);
const before = await rss();
let session = kind === "cortex" ? await InferenceSession.create(model, { policy: "strict" })
  : await ort.InferenceSession.create(/^https?:/.test(model) ? new Uint8Array(await (await fetch(model)).arrayBuffer())
    : new Uint8Array(fs.readFileSync(model)),
    { executionProviders: ["wasm"], graphOptimizationLevel: "all" });
let results = await session.run(feeds);
results = null;
const afterRun = await rss();
await session.release();
const afterRelease = await rss();
session = null;
feeds = null;
const afterDrop = await rss();
console.log(JSON.stringify({ before, after_run: afterRun, after_release: afterRelease, after_drop: afterDrop }));
process.exit(0);
