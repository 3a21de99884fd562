// The example page of `cortex bundle`: load dag.json and its modules, run the model once on the
// example inputs (the first specialization's, for a dag.json of several input shapes), show the
// outputs and a bar chart of each CU's time. A language model compiled for generation gets a
// prompt-ids box instead, and its greedy ids appear one by one as they are made (`?prompt=1,2,3`
// and `?tokens=N` fill the form and run it at load); the chart shows the last step. `?policy=NAME` runs under that policy (`offline`: the
// source model on onnxruntime-web, which the runtime imports by name: a bundle that carries it maps
// the name in index.html). `?threads=N` is `numThreads`: Workers running independent CUs at once on a
// page that is not cross-origin isolated, a CU's kernel threads on one that is (and a threads build);
// the status line says which ran. The status line counts the bytes and CUs loaded while `create` runs. `window.cortexBundle` holds what the page found, for scripts that drive
// it (the tests read it).
import { InferenceSession, exampleFeeds, isLanguageModel } from "./cortex-runtime/index.js";

const SHOWN_VALUES = 8;
const DEFAULT_PROMPT = "1 2 3 4";
const DEFAULT_NEW_TOKENS = 16;
const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));

/** @param {string} tag @param {Record<string, string | number>} attributes @param {string} [text] */
function svg(tag, attributes, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

/** One bar per activated CU, its length its milliseconds. @param {any[]} cus */
function chart(cus) {
  const bar = 18, label = 110, width = 600, longest = Math.max(...cus.map((t) => t.seconds), 1e-9);
  const root = svg("svg", { width: label + width + 90, height: cus.length * (bar + 4) + 4, role: "img",
    "aria-label": "milliseconds per computation unit" });
  cus.forEach((t, i) => {
    const y = 2 + i * (bar + 4), w = Math.max(1, (t.seconds / longest) * width);
    const row = svg("g", {});
    const variant = t.precision ? ` ${t.precision}` : "";         // a reduced-precision variant ran
    row.append(svg("title", {}, `${t.cu}${variant}: ${t.op_types.join(", ")}`));
    row.append(svg("text", { x: 0, y: y + bar - 5 }, `${t.cu}${variant}`));
    row.append(svg("rect", { x: label, y, width: w, height: bar }));
    row.append(svg("text", { x: label + w + 6, y: y + bar - 5 }, `${(t.seconds * 1e3).toFixed(3)} ms`));
    root.append(row);
  });
  $("chart").replaceChildren(root);
}

/** @param {Record<string, any>} outputs */
function table(outputs) {
  for (const [name, t] of Object.entries(outputs)) {
    const row = document.createElement("tr");
    const values = Array.from(t.data.slice(0, SHOWN_VALUES), (v) => Number(v).toPrecision(5)).join(", ");
    for (const text of [name, t.type, `[${t.dims.join(", ")}]`, values + (t.size > SHOWN_VALUES ? ", …" : "")]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.append(cell);
    }
    row.lastElementChild?.classList.add("values");
    $("outputs").append(row);
  }
}

/** Generates from the form's prompt, each id added to the page before the next is made.
 * @param {any} session @param {number} loadMs */
async function generateFromForm(session, loadMs) {
  const prompt = /** @type {HTMLInputElement} */ ($("prompt")).value.split(/[\s,]+/).filter(Boolean).map(Number);
  const maxNewTokens = Number(/** @type {HTMLInputElement} */ ($("tokens")).value);
  const shown = $("generated");
  shown.replaceChildren();
  /** @type {{id: number, shown: number}[]} */
  const streamed = [];
  $("status").textContent = `Loaded ${session.sections.length} specializations in ${loadMs.toFixed(1)} ms; generating…`;
  $("status").dataset.state = "loading";
  const generated = await session.generate(prompt, { maxNewTokens, onToken: (/** @type {number} */ id) => {
    const token = document.createElement("span");
    token.textContent = `${id} `;
    shown.append(token);
    streamed.push({ id, shown: shown.children.length });
    return new Promise((resolve) => setTimeout(resolve, 0));     // lets the browser paint it
  } });
  const record = session.lastGeneration;
  const decodeMs = record.decode_ms.reduce((/** @type {number} */ a, /** @type {number} */ b) => a + b, 0) / Math.max(1, record.decode_ms.length);
  $("status").textContent = `Loaded ${session.sections.length} specializations in ${loadMs.toFixed(1)} ms; generated `
    + `${generated.length} tokens: the first after ${record.ttft_ms.toFixed(1)} ms, then ${decodeMs.toFixed(2)} ms each. `
    + "The chart shows the last step.";
  $("status").dataset.state = "done";
  const trace = session.lastTrace;
  chart(trace.cus);
  return { status: "done", loadMs, generated, streamed, generation: record, trace };
}

/** The generation form, filled from the URL and run once. @param {any} session @param {number} loadMs */
function generationPage(session, loadMs) {
  const query = new URLSearchParams(location.search);
  $("example").hidden = true;
  $("generate").hidden = false;
  /** @type {HTMLInputElement} */ ($("prompt")).value = query.get("prompt")?.replaceAll(",", " ") ?? DEFAULT_PROMPT;
  /** @type {HTMLInputElement} */ ($("tokens")).value = query.get("tokens") ?? String(DEFAULT_NEW_TOKENS);
  $("generate-form").addEventListener("submit", (event) => {
    event.preventDefault();
    settle(generateFromForm(session, loadMs));
  });
  return generateFromForm(session, loadMs);
}

/** The status line while `create` loads, and the events, in order, for `window.cortexBundle`.
 * @param {any[]} events */
function showProgress(events) {
  return (/** @type {{bytes: number, totalBytes: number, cus: number, totalCus: number}} */ p) => {
    events.push({ ...p });
    $("status").textContent = `Loading: ${(p.bytes / 2 ** 20).toFixed(1)} of ${(p.totalBytes / 2 ** 20).toFixed(1)} MB, `
      + `${p.cus} of ${p.totalCus} CUs…`;
  };
}

/** How the last request used threads, in words. @param {any} trace */
function threadsText(trace) {
  const threads = trace.threads;
  if (!threads || threads.mode === undefined || threads.mode === "single") return "on one thread";
  return `on ${threads.threads} threads (${threads.mode}${threads.walk ? `, ${threads.walk} walk` : ""})`;
}

async function main() {
  const query = new URLSearchParams(location.search);
  const policy = query.get("policy") ?? undefined;
  const numThreads = query.has("threads") ? Number(query.get("threads")) : undefined;
  /** @type {any[]} */
  const progress = [];
  const started = performance.now();
  const session = await InferenceSession.create(new URL("dag.json", location.href).href,
    { policy, numThreads, onProgress: showProgress(progress) });
  const loadMs = performance.now() - started;
  $("model").textContent = session.dag.model?.name ?? "the model";
  if (isLanguageModel(session)) return generationPage(session, loadMs);
  const outputs = await session.run(exampleFeeds(session.inputMetadata));
  const trace = session.lastTrace;
  const on = session.specialization === null ? "" : ` (specialization ${session.specialization}, `
    + `one of ${session.sections.length})`;
  const ms = (trace.total_seconds * 1e3).toFixed(2);
  $("status").textContent = trace.offline
    ? `Loaded the source model ${trace.offline.model}${on} on onnxruntime-web in ${loadMs.toFixed(1)} ms (offline policy); ran it in ${ms} ms.`
    : `Loaded ${session.dag.cus.length} CUs${on} in ${loadMs.toFixed(1)} ms (fetch, sha256, compile); `
      + `ran ${trace.activated_cus.length} in ${ms} ms ${threadsText(trace)}; `
      + `${globalThis.crossOriginIsolated ? "" : "not "}cross-origin isolated.`;
  $("status").dataset.state = "done";
  table(outputs);
  chart(trace.cus);
  return { status: "done", loadMs, trace, specialization: session.specialization, progress,
    isolated: Boolean(globalThis.crossOriginIsolated),
    outputs: Object.fromEntries(Object.entries(outputs).map(([name, t]) => [name,
      { type: t.type, dims: [...t.dims], data: Array.from(t.data, Number) }])) };
}

/** What a run of the page found, or its error, into the status line and `window.cortexBundle`. @param {Promise<any>} run */
function settle(run) {
  /** @type {any} */ (window).cortexBundle = { status: "loading" };
  run.then((found) => { /** @type {any} */ (window).cortexBundle = found; }, (e) => {
    $("status").textContent = `${e.name}: ${e.message}`;
    $("status").dataset.state = "error";
    /** @type {any} */ (window).cortexBundle = { status: "error", error: `${e.name}: ${e.message}` };
  });
}

settle(main());
