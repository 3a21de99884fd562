// The example page of `cortex bundle`: load dag.json and its modules, run the model once on the
// example inputs (the first specialization's, for a dag.json of several input shapes), show the
// outputs and a bar chart of each CU's time. `?policy=NAME` runs under that policy (`offline`: the
// source model on onnxruntime-web, which the runtime imports by name: a bundle that carries it maps
// the name in index.html). `window.cortexBundle` holds what the page found, for scripts that drive
// it (the tests read it).
import { InferenceSession, exampleFeeds } from "./cortex-runtime/index.js";

const SHOWN_VALUES = 8;
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

async function main() {
  const policy = new URLSearchParams(location.search).get("policy") ?? undefined;
  const started = performance.now();
  const session = await InferenceSession.create(new URL("dag.json", location.href).href, { policy });
  const loadMs = performance.now() - started;
  $("model").textContent = session.dag.model?.name ?? "the model";
  const outputs = await session.run(exampleFeeds(session.inputMetadata));
  const trace = session.lastTrace;
  const on = session.specialization === null ? "" : ` (specialization ${session.specialization}, `
    + `one of ${session.sections.length})`;
  const ms = (trace.total_seconds * 1e3).toFixed(2);
  $("status").textContent = trace.offline
    ? `Loaded the source model ${trace.offline.model}${on} on onnxruntime-web in ${loadMs.toFixed(1)} ms (offline policy); ran it in ${ms} ms.`
    : `Loaded ${session.dag.cus.length} CUs${on} in ${loadMs.toFixed(1)} ms (fetch, sha256, compile); `
      + `ran ${trace.activated_cus.length} in ${ms} ms.`;
  $("status").dataset.state = "done";
  table(outputs);
  chart(trace.cus);
  return { status: "done", loadMs, trace, specialization: session.specialization,
    outputs: Object.fromEntries(Object.entries(outputs).map(([name, t]) => [name,
      { type: t.type, dims: [...t.dims], data: Array.from(t.data, Number) }])) };
}

/** @type {any} */ (window).cortexBundle = { status: "loading" };
main().then((found) => { /** @type {any} */ (window).cortexBundle = found; }, (e) => {
  $("status").textContent = `${e.name}: ${e.message}`;
  $("status").dataset.state = "error";
  /** @type {any} */ (window).cortexBundle = { status: "error", error: `${e.name}: ${e.message}` };
});
