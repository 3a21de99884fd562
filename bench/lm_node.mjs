// The Node side of `make bench-language-models`: one language model (onnxruntime-genai's builder
// layout: input_ids, attention_mask, past_key_values.N.key/.value in, logits and present.N.* out,
// GroupQueryAttention sharing one past/present buffer) run token by token, one thread, by
// onnxruntime-web and by Cortex's JavaScript runtime (session.generate).
//
// onnxruntime-web has no generation loop, so this script is one, the loop Cortex's runtimes run:
// the past buffers [1, heads, P, head size] are fed whole, the mask is 1 for the L + S positions
// in use, and the S rows the model writes at L (present[:, :, L:L+S]) are copied back; the next
// token is the logits' first largest (greedy). Rewinding to a prefilled length only resets L: rows
// beyond it are masked, so decode rounds start from the same state without running the prompt again.
//
// One JSON request per stdin line, one JSON answer per stdout line (line_protocol.mjs):
//   {"cmd": "ortweb", "model": "folder/model.onnx", "data": "model.onnx.data"}          -> {"load_seconds"}
//   {"cmd": "prefill", "ids": [...], "bucket": P}        -> {"seconds", "cpu_seconds"}: the prompt in one call;
//        the cache keeps its rows (the state `decode` starts from)
//   {"cmd": "decode", "skip": n, "repeat": n}            -> {"seconds": [...], "cpu_seconds": [...], "tokens"}:
//        `skip` untimed steps then `repeat` timed ones from the prefilled state, which is then restored;
//        tokens: the prompt's next token and each step's
//   {"cmd": "cortex", "dag": "dag.json"}                 -> {"load_seconds"}: Cortex's runtime, strict policy
//   {"cmd": "generate", "ids": [...], "skip": n, "repeat": n} -> {"seconds", "cpu_seconds", "tokens", "ttft_seconds"}:
//        session.generate on the prompt; the times between consecutive tokens after `skip` of them
//   {"cmd": "version"}, {"cmd": "quit"}
// CPU seconds are the whole Node process's (V8's helper threads count too).
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { performance } from "node:perf_hooks";
import { serveLines } from "./ortweb/line_protocol.mjs";
import { InferenceSession } from "../js/src/index.js";

// onnxruntime-web as make installs it for the benches (bench/ortweb, pinned by its package-lock.json)
const ort = createRequire(new URL("./ortweb/", import.meta.url))("onnxruntime-web");
ort.env.wasm.numThreads = 1;
ort.env.logLevel = "error";

let web = null;        // {session, pasts, presents, heads, width, vocabulary}
let state = null;      // {bucket, length, buffers: Map(past -> Float32Array), prefilled}
let cortex = null;

function stopwatch() {
  const start = performance.now(), cpu = process.cpuUsage();
  return () => {
    const used = process.cpuUsage(cpu);
    return [(performance.now() - start) / 1000, (used.user + used.system) / 1e6];
  };
}

async function loadOrtweb(req) {
  const done = stopwatch();
  const session = await ort.InferenceSession.create(new Uint8Array(fs.readFileSync(req.model)), {
    executionProviders: ["wasm"], graphOptimizationLevel: "all",
    externalData: [{ path: path.basename(req.data), data: new Uint8Array(fs.readFileSync(req.data)) }],
  });
  const pasts = session.inputNames.filter((n) => n.startsWith("past_key_values."));
  web = { session, pasts, presents: pasts.map((n) => n.replace("past_key_values", "present")),
    heads: req.heads, width: req.head_size };
  return { load_seconds: done()[0] };
}

function argmax(data, from) {
  let best = from;
  for (let i = from + 1; i < data.length; i++) if (data[i] > data[best]) best = i;
  return best - from;
}

/** Runs `ids` at the cache's length; returns the next token (greedy on the last position's logits). */
async function step(ids) {
  const { bucket, length, buffers } = state;
  const mask = new BigInt64Array(bucket);
  mask.fill(1n, 0, length + ids.length);
  const feeds = {
    input_ids: new ort.Tensor("int64", BigInt64Array.from(ids, BigInt), [1, ids.length]),
    attention_mask: new ort.Tensor("int64", mask, [1, bucket]),
  };
  for (const past of web.pasts) feeds[past] = new ort.Tensor("float32", buffers.get(past), [1, web.heads, bucket, web.width]);
  const out = await web.session.run(feeds);
  web.pasts.forEach((past, i) => {
    // [1, heads, bucket, width]: each head's rows L..L+S-1
    const present = out[web.presents[i]].data, buffer = buffers.get(past);
    for (let h = 0; h < web.heads; h++) {
      const from = (h * bucket + length) * web.width;
      buffer.set(present.subarray(from, from + ids.length * web.width), from);
    }
  });
  state.length += ids.length;
  const logits = out.logits.data;
  const token = argmax(logits, logits.length - logits.length / out.logits.dims[1]);
  for (const tensor of Object.values(out)) tensor.dispose?.();
  return token;
}

async function prefill(req) {
  const buffers = new Map(web.pasts.map((p) => [p, new Float32Array(web.heads * req.bucket * web.width)]));
  state = { bucket: req.bucket, length: 0, buffers };
  const done = stopwatch();
  const token = await step(req.ids);
  const [seconds, cpu_seconds] = done();
  state.prefilled = { length: state.length, token };
  return { seconds, cpu_seconds };
}

async function decode(req) {
  const seconds = [], cpu_seconds = [], tokens = [state.prefilled.token];
  for (let i = 0; i < req.skip + req.repeat; i++) {
    const done = stopwatch();
    tokens.push(await step([tokens[tokens.length - 1]]));
    const [wall, cpu] = done();
    if (i >= req.skip) { seconds.push(wall); cpu_seconds.push(cpu); }
  }
  state.length = state.prefilled.length;
  return { seconds, cpu_seconds, tokens };
}

async function loadCortex(req) {
  const done = stopwatch();
  cortex = await InferenceSession.create(req.dag, { policy: "strict" });
  return { load_seconds: done()[0] };
}

async function generate(req) {
  const seconds = [], cpu_seconds = [];
  let lap = stopwatch(), made = 0;
  const tokens = await cortex.generate(req.ids, {
    maxNewTokens: req.skip + req.repeat + 1,
    onToken: () => {
      const [wall, cpu] = lap();
      if (made > req.skip) { seconds.push(wall); cpu_seconds.push(cpu); }
      made += 1;
      lap = stopwatch();
    },
  });
  return { seconds, cpu_seconds, tokens, ttft_seconds: cortex.lastGeneration.ttft_ms / 1000 };
}

async function version() {
  return { web: ort.env.versions.web, node: process.versions.node };
}

await serveLines({ ortweb: loadOrtweb, prefill, decode, cortex: loadCortex, generate, version });
