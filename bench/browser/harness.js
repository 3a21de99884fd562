// The browser side of `make bench-js` (bench/browser_js.py): Cortex's JavaScript runtime and
// onnxruntime-web driven by one request at a time, on a page's main thread or in a module Worker
// (worker.js) of it. The site is a `cortex bundle` folder with onnxruntime-web's dist under ortweb/,
// this folder under bench/ and the inputs as raw .bin files; requests name those by URL.
//   {cmd: "create", id, kind: "cortex" | "ortweb", model, inputs, options}  -> {create_ms, threads}
//   {cmd: "time", id, repeat}                -> {ms: [...]} wall time per run (performance.now)
//   {cmd: "outputs", id}                     -> {outputs: {name: [numbers]}}
//   {cmd: "release", id}
//   {cmd: "first", kind, model, inputs, runtime?} -> {ms, import_ms, create_ms, run_ms}: runtime import
//        (Cortex's from `runtime`, the page's URL of it, when given) + create + first run, nothing held after
//   {cmd: "phases", model, weights}          -> ms of each load phase of a dag.json's files, done one
//        phase at a time by hand (fetch, sha256, compile, Cache API, instantiate, weights written)
//   {cmd: "memory", phase: "before" | "run" | "release", kind, model, inputs, options} -> {}: the phase done and
//        garbage collected (gc exposed), for memory.html, whose server reads the renderers' RSS then
// Wall time only: a page has no CPU clock. onnxruntime-web's thread count is fixed by the first
// session of a realm, so each ort thread count lives in its own page or Worker.

const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, uint8: Uint8Array, bool: Uint8Array };
const CORTEX_URL = new URL("../cortex-runtime/index.js", import.meta.url).href;
const ORTWEB_URL = new URL("../ortweb/ort.wasm.bundle.min.mjs", import.meta.url).href;

/** A URL of the site, absolute (requests give them from the site's root). @param {string} url */
const onSite = (url) => new URL(url, globalThis.location.href).href;

/** id -> {session, feeds} */
const sessions = new Map();

/** The runtime's module; onnxruntime-web's threads set before its first session. */
async function runtime(kind, ortThreads = 1) {
  if (kind === "cortex") return import(CORTEX_URL);
  const ort = await import(ORTWEB_URL);
  ort.env.wasm.numThreads = ortThreads;
  ort.env.logLevel = "error";
  return ort;
}

async function feedsFrom(inputs, Tensor) {
  const feeds = {};
  for (const input of inputs) {
    const bytes = await (await fetch(onSite(input.url))).arrayBuffer();
    feeds[input.name] = new Tensor(input.dtype, new ARRAYS[input.dtype](bytes), input.shape);
  }
  return feeds;
}

/** A session of either runtime. `options`: Cortex's create options, or {numThreads} for onnxruntime-web. */
async function createSession(module, kind, model, options = {}) {
  if (kind === "cortex") return module.InferenceSession.create(onSite(model), { policy: "strict", ...options });
  const bytes = new Uint8Array(await (await fetch(onSite(model))).arrayBuffer());
  return module.InferenceSession.create(bytes, { executionProviders: ["wasm"], graphOptimizationLevel: "all" });
}

async function create(req) {
  const module = await runtime(req.kind, req.options?.numThreads ?? 1);
  const feeds = await feedsFrom(req.inputs, module.Tensor);
  const start = performance.now();
  const session = await createSession(module, req.kind, req.model, req.kind === "cortex" ? req.options : {});
  const createMs = performance.now() - start;
  sessions.set(req.id, { session, feeds });
  await session.run(feeds);
  return { create_ms: createMs, threads: req.kind === "cortex" ? session.lastTrace?.threads ?? null
           : { ort_threads: module.env.wasm.numThreads, isolated: globalThis.crossOriginIsolated } };
}

async function time(req) {
  const { session, feeds } = sessions.get(req.id);
  const ms = [];
  for (let i = 0; i < req.repeat; i++) {
    const start = performance.now();
    await session.run(feeds);
    ms.push(performance.now() - start);
  }
  return { ms };
}

async function outputs(req) {
  const { session, feeds } = sessions.get(req.id);
  const results = await session.run(feeds);
  return { outputs: Object.fromEntries(Object.entries(results).map(([k, t]) => [k, Array.from(t.data, Number)])) };
}

async function release(req) {
  const held = sessions.get(req.id);
  sessions.delete(req.id);
  await held?.session.release?.();
  return {};
}

async function first(req) {
  const start = performance.now();
  const module = req.kind === "cortex" && req.runtime ? await import(onSite(req.runtime)) : await runtime(req.kind);
  const feeds = await feedsFrom(req.inputs, module.Tensor);
  const imported = performance.now();
  const session = await createSession(module, req.kind, req.model);
  const created = performance.now();
  await session.run(feeds);
  const ms = performance.now() - start;
  await session.release?.();
  return { ms, import_ms: imported - start, create_ms: created - imported, run_ms: start + ms - created };
}

/** The phases of loading a dag.json's files, each over every file at once and timed on its own (what
 * the runtime overlaps, taken apart): fetch, sha256, WebAssembly.compile from bytes, compileStreaming
 * from a Cache API Response, instantiate (data segments copied), weight files written. */
async function phases(req) {
  const base = new URL(onSite(req.model));
  const dag = await (await fetch(base)).json();
  const records = [...new Map(dag.cus.filter((cu) => cu.artifacts?.wasm)
    .map((cu) => [cu.artifacts.wasm.path, cu.artifacts.wasm])).values()];
  const weightEntries = [...new Map(records.flatMap((r) => r.weights ?? []).map((w) => [w.path, w])).values()];
  const ms = {};
  let mark = performance.now();
  const lap = (name) => { const now = performance.now(); ms[name] = now - mark; mark = now; };
  const bytes = await Promise.all(records.map(async (r) => new Uint8Array(await (await fetch(new URL(r.path, base))).arrayBuffer())));
  lap("fetch_modules");
  const weights = await Promise.all(weightEntries.map(async (w) => new Uint8Array(await (await fetch(new URL(w.path, base))).arrayBuffer())));
  lap("fetch_weights");
  await Promise.all([...bytes, ...weights].map((b) => crypto.subtle.digest("SHA-256", b)));
  lap("sha256");
  const modules = await Promise.all(bytes.map((b) => WebAssembly.compile(b)));
  lap("compile");
  const cache = await caches.open("phases-probe");
  await Promise.all(bytes.map((b, i) => cache.put(`/phases-probe/${i}.wasm`, new Response(b, { headers: { "content-type": "application/wasm" } }))));
  lap("cache_put");
  await Promise.all(bytes.map(async (b, i) => WebAssembly.compileStreaming(await cache.match(`/phases-probe/${i}.wasm`))));
  lap("cache_compile_streaming");
  await Promise.all(bytes.map(async (b, i) => (await cache.match(`/phases-probe/${i}.wasm`)).arrayBuffer()));
  lap("cache_read");
  await caches.delete("phases-probe");
  const instances = await Promise.all(modules.map((m) => WebAssembly.instantiate(m, {})));
  lap("instantiate");
  for (const [i, r] of records.entries()) {
    const memory = Object.values(instances[i].exports).find((e) => e instanceof WebAssembly.Memory);
    for (const w of r.weights ?? []) new Uint8Array(memory.buffer, w.offset, w.bytes).set(weights[weightEntries.indexOf(weightEntries.find((e) => e.path === w.path))]);
  }
  lap("write_weights");
  return { ms, modules: records.length, module_bytes: bytes.reduce((n, b) => n + b.byteLength, 0),
           weight_files: weights.length, weight_bytes: weights.reduce((n, b) => n + b.byteLength, 0) };
}

/** Garbage collected (three passes where gc is exposed), and time for the engine to give pages back. */
async function collected() {
  for (let i = 0; i < 3; i++) globalThis.gc?.();
  await new Promise((resolve) => setTimeout(resolve, 300));
}

/** The contestant of the memory phases: {module, feeds, session}. */
let measuredOne = null;

/** One phase of the memory figure: "before" imports the runtime and reads the inputs, "run" (and
 * "run2", a later session on the same page) creates a session and runs it once, "release" (and
 * "release2") releases it (the session object still held); each ends
 * collected, so the caller can read the renderer's RSS between phases. (measureUserAgentSpecificMemory
 * counts no non-shared WebAssembly.Memory in this Chromium: tests/test_js_memory_browser.py.) */
async function memory(req) {
  if (req.phase === "before") {
    const module = await runtime(req.kind);
    measuredOne = { module, feeds: await feedsFrom(req.inputs, module.Tensor), session: null };
  } else if (req.phase.startsWith("run")) {
    measuredOne.session = await createSession(measuredOne.module, req.kind, req.model, req.options ?? {});
    await measuredOne.session.run(measuredOne.feeds);
  } else {
    await measuredOne.session.release();
  }
  await collected();
  return {};
}

const handlers = { create, time, outputs, release, first, phases, memory };

/** One request; errors come back as {error} in one line. */
export async function handle(req) {
  try {
    return await handlers[req.cmd](req);
  } catch (e) {
    return { error: String(e?.message ?? e).split("\n")[0] };
  }
}
