// The Node side of `make bench`: onnxruntime-web sessions and raw WebAssembly modules, timed in V8.
// It reads one JSON request per line on stdin and answers one JSON line on stdout, so the Python
// driver can interleave its contestants without paying Node's start-up for each measurement.
//   {"cmd": "load", "id": "m", "model": "path.onnx", "inputs": [{"name", "dtype", "shape", "data": "file.bin"}]}
//   {"cmd": "wasm", "id": "g", "module": "gemm.wasm", "export": "gemm", "args": [], "data": [[offset, "file.bin"]]}
//   {"cmd": "time", "id": "m", "warmup": 2, "repeat": 10}   -> {"ok": true, "seconds": [...], "cpu_seconds": [...]}
//   {"cmd": "version"}                                        -> {"ok": true, "web": "1.30.0", ...}
//   {"cmd": "quit"}
import fs from "node:fs";
import { serveLines } from "./line_protocol.mjs";
import { performance } from "node:perf_hooks";
import * as ort from "onnxruntime-web";

ort.env.wasm.numThreads = 1;  // one thread, like the other contestants
ort.env.logLevel = "error";

const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, uint8: Uint8Array, bool: Uint8Array };
const contestants = new Map();

function tensorFrom(input) {
  const raw = fs.readFileSync(input.data);
  const Array_ = ARRAYS[input.dtype];
  if (!Array_) throw new Error(`unsupported input dtype ${input.dtype}`);
  const data = new Array_(raw.buffer, raw.byteOffset, raw.byteLength / Array_.BYTES_PER_ELEMENT);
  return new ort.Tensor(input.dtype, data.slice(), input.shape);
}

async function load(req) {
  const session = await ort.InferenceSession.create(new Uint8Array(fs.readFileSync(req.model)),
    { executionProviders: ["wasm"], graphOptimizationLevel: "all" });
  const feeds = {};
  for (const input of req.inputs) feeds[input.name] = tensorFrom(input);
  contestants.set(req.id, async () => { await session.run(feeds); });
  return { version: ort.env.versions.web };
}

async function loadWasm(req) {
  const { instance } = await WebAssembly.instantiate(fs.readFileSync(req.module), {});
  const memory = new Uint8Array(instance.exports.memory.buffer);
  for (const [offset, file] of req.data || []) memory.set(fs.readFileSync(file), offset);
  const fn = instance.exports[req.export];
  const args = req.args || [];
  contestants.set(req.id, async () => { fn(...args); });
  return { v8: process.versions.v8 };
}

async function time(req) {
  const run = contestants.get(req.id);
  if (!run) throw new Error(`nothing loaded as ${req.id}`);
  for (let i = 0; i < (req.warmup ?? 0); i++) await run();
  const seconds = [], cpu_seconds = [];
  for (let i = 0; i < req.repeat; i++) {
    const start = performance.now(), cpu = process.cpuUsage();
    await run();
    const used = process.cpuUsage(cpu);  // the whole process: V8's helper threads count too
    seconds.push((performance.now() - start) / 1000);
    cpu_seconds.push((used.user + used.system) / 1e6);
  }
  return { seconds, cpu_seconds };
}

async function version() {
  return { web: ort.env.versions.web, node: process.versions.node, v8: process.versions.v8 };
}

const handlers = { load, wasm: loadWasm, time, version };
await serveLines(handlers);
