// The Node side of `make bench-js`: Cortex's JavaScript runtime (js/) against onnxruntime-web in the
// same Node, one thread each. It speaks runner.mjs's protocol (one JSON request per line on stdin,
// one JSON answer per line on stdout) with these requests:
//   {"cmd": "serve", "root": "folder"}                        -> {"url": "http://127.0.0.1:PORT/"}
//   {"cmd": "ortweb", "id", "model": "URL of .onnx", "inputs": [{"name", "dtype", "shape", "data": "file.bin"}]}
//   {"cmd": "cortex", "id", "dag": "URL of dag.json", "inputs": [...]}
//   {"cmd": "time", "id", "warmup", "repeat"}                 -> {"seconds": [...], "cpu_seconds": [...]}
//   {"cmd": "load", "id", "repeat"}                           -> {"seconds": [...]}: fresh sessions, each
//        fetched over http and compiled (Cortex: dag.json + modules, sha256 checked; onnxruntime-web:
//        the .onnx file + session creation)
//   {"cmd": "agree", "a", "b"}                                -> {"max_abs": x}: the two contestants' outputs
//   {"cmd": "version"}, {"cmd": "quit"}
// Node runs with --expose-gc: before each timed load the previous sessions are collected, so that
// V8's cache of compiled modules (keyed by their bytes, while a module lives) cannot serve a load.
import fs from "node:fs";
import http from "node:http";
import path from "node:path";
import { serveLines } from "./line_protocol.mjs";
import { performance } from "node:perf_hooks";
import * as ort from "onnxruntime-web";
import { InferenceSession, Tensor } from "../../js/src/index.js";

ort.env.wasm.numThreads = 1;
ort.env.logLevel = "error";

const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, uint8: Uint8Array, bool: Uint8Array };
const MIME = { ".json": "application/json", ".wasm": "application/wasm", ".onnx": "application/octet-stream" };
/** id -> {create: () => Promise<session>, session, feeds, run} */
const contestants = new Map();

function feedsFrom(inputs, TensorType) {
  const feeds = {};
  for (const input of inputs) {
    const raw = fs.readFileSync(input.data);
    const Array_ = ARRAYS[input.dtype];
    const data = new Array_(raw.buffer, raw.byteOffset, raw.byteLength / Array_.BYTES_PER_ELEMENT).slice();
    feeds[input.name] = new TensorType(input.dtype, data, input.shape);
  }
  return feeds;
}

async function serve(req) {
  const root = path.resolve(req.root);
  const server = http.createServer((request, response) => {
    const file = path.join(root, decodeURIComponent(new URL(request.url, "http://x").pathname));
    if (!file.startsWith(root + path.sep) || !fs.existsSync(file)) { response.writeHead(404).end(); return; }
    response.writeHead(200, { "content-type": MIME[path.extname(file)] ?? "application/octet-stream" });
    fs.createReadStream(file).pipe(response);
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  server.unref();
  return { url: `http://127.0.0.1:${server.address().port}/` };
}

async function add(id, create, feeds) {
  const start = performance.now();
  const session = await create();
  const seconds = (performance.now() - start) / 1000;
  contestants.set(id, { create, session, feeds, run: () => session.run(feeds, undefined) });
  return { first_load_seconds: seconds };
}

async function ortweb(req) {
  const create = async () => ort.InferenceSession.create(new Uint8Array(await (await fetch(req.model)).arrayBuffer()),
    { executionProviders: ["wasm"], graphOptimizationLevel: "all" });
  return { ...(await add(req.id, create, feedsFrom(req.inputs, ort.Tensor))), version: ort.env.versions.web };
}

async function cortex(req) {
  const create = () => InferenceSession.create(req.dag, { policy: "strict" });   // every CU runs, no cache
  return add(req.id, create, feedsFrom(req.inputs, Tensor));
}

async function time(req) {
  const { run } = contestants.get(req.id);
  for (let i = 0; i < (req.warmup ?? 0); i++) await run();
  const seconds = [], cpu_seconds = [];
  for (let i = 0; i < req.repeat; i++) {
    const start = performance.now(), cpu = process.cpuUsage();
    await run();
    const used = process.cpuUsage(cpu);
    seconds.push((performance.now() - start) / 1000);
    cpu_seconds.push((used.user + used.system) / 1e6);
  }
  return { seconds, cpu_seconds };
}

async function load(req) {
  const contestant = contestants.get(req.id);
  // The run session's CUs give their memories back first: each memory reserves address space, and
  // a model of ~150 CUs twice over is more than the engine grants one process (vgg19 was refused).
  if (!contestant.released) {
    await contestant.session.release?.();
    for (let i = 0; i < 4; i++) {      // a dropped memory is unmapped by a collection, given turns of the event loop
      globalThis.gc?.();
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
  }
  contestant.released = true;
  const seconds = [];
  for (let i = 0; i < req.repeat; i++) {
    globalThis.gc?.();
    const start = performance.now();
    const session = await contestant.create();
    seconds.push((performance.now() - start) / 1000);
    if (session.release && session !== contestant.session) await session.release();
  }
  return { seconds };
}

async function agree(req) {
  const [a, b] = [contestants.get(req.a), contestants.get(req.b)];
  const [x, y] = [await a.run(), await b.run()];
  let worst = 0;
  for (const name of Object.keys(x)) {
    const [p, q] = [x[name].data, y[name].data];
    if (p.length !== q.length) return { max_abs: null, error: `${name}: ${p.length} vs ${q.length} values` };
    for (let i = 0; i < p.length; i++) worst = Math.max(worst, Math.abs(Number(p[i]) - Number(q[i])));
  }
  return { max_abs: worst };
}

const version = async () => ({ web: ort.env.versions.web, node: process.versions.node, v8: process.versions.v8 });
const handlers = { serve, ortweb, cortex, time, load, agree, version };
await serveLines(handlers);
