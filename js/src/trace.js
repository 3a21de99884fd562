// The trace of one request, in the shape of the Python runtime's (docs/runtime.md, schema
// cortex/schemas/trace.schema.json). What differs is only what an engine can measure: there is
// no per-thread CPU clock in a browser, so `cpu_time_ms` is the process's CPU time in Node
// (process.cpuUsage, V8's helper threads included) and the CUs' wall time in a browser;
// `peak_memory_mb` is the loaded CUs' memories plus the tensors the request holds, as in Python.

import { runnableRecord } from "./features.js";

const IN_NODE = typeof process !== "undefined" && typeof process.cpuUsage === "function";
const MB = 2 ** 20;
export const TRACE_SCHEMA = "cortex.trace/1";
export const FALLBACK_RUNTIME = "fallback runtime";
// The Python sandbox's counters. Here a trap ends the request as a CortexError and the engine
// sets no deadlines or memory limits of its own, so nothing is stopped, limited or rebuilt.
const NO_SANDBOX = { traps: 0, timeouts: 0, memory_limit_hits: 0, rebuilt: 0 };

/** Milliseconds, monotonic. */
export const clock = () => performance.now();

/** Seconds of CPU time where the engine can tell, wall time otherwise. */
export function cpuClock() {
  if (IN_NODE) {
    const { user, system } = process.cpuUsage();
    return (user + system) / 1e6;
  }
  return performance.now() / 1000;
}

function processMaxrssMb() {
  return IN_NODE && typeof process.resourceUsage === "function" ? process.resourceUsage().maxRSS / 1024 : 0;
}

/** @param {string|null} policy @param {string} dag @param {string[]} outputs */
function header(policy, dag, outputs) {
  return { schema: TRACE_SCHEMA, policy, device: "wasm", dag, requested_outputs: [...outputs] };
}

/** `lastTrace` before the first request. @param {string} dag */
export function emptyTrace(dag) {
  return { ...header(null, dag, []), activated_cus: [], skipped_cus: [], approximated_cus: [], fell_back_cus: [],
    sandbox_stats: { cpu_time_ms: 0, peak_memory_mb: 0, peak_memory_basis: "loaded CUs + live tensors",
      process_maxrss_mb: processMaxrssMb(), wasm_executions: 0, ...NO_SANDBOX },
    cache: null, memory: null, offline: null, cus_by_device: {}, total_seconds: 0, cus: [], traceEvents: [] };
}

/** The trace's entry of a CU that ran (docs/runtime.md), from what `ran` recorded.
 * @param {import("./scheduler.js").Activation} a */
function activationEntry(a) {
  const { cu, where, bytesIn, bytesOut } = a.step;
  return { cu: cu.id, device: where, op_types: cu.op_types ?? [], start: a.start, seconds: a.seconds,
    cpu_seconds: a.cpuSeconds, bytes_in: bytesIn, bytes_out: bytesOut, bytes_from_other_devices: a.crossed,
    resident_bytes: a.residentBytes, ...ranFeatures(cu, a.variant?.precision), ...a.variant };
}

/** `wasm_features`: the features of the module that ran the CU (or its variant), the primary's or
 * the alternate's this engine picked (js/src/features.js); nothing for a fallback CU.
 * @param {import("./dag.js").CU} cu @param {string} [precision] */
function ranFeatures(cu, precision) {
  const record = precision === undefined ? cu.artifacts?.wasm : cu.variants?.[precision]?.artifacts?.wasm;
  const ran = cu.runs_on === undefined && record ? runnableRecord(record) : null;
  return ran ? { wasm_features: ran.options.features } : {};
}

/** The entries of a segment's CUs (js/src/plan.js): its time shared out by their flops, as
 * Python's are, each saying the segment's length. @param {import("./plan.js").SegmentRun} run */
function segmentEntries({ segment, start, seconds, cpuSeconds }) {
  const length = segment.steps.length;
  let at = start;
  return segment.steps.map((step, i) => {
    const share = segment.shares[i];
    const { cu, where, bytesIn, bytesOut } = step;
    const entry = { cu: cu.id, device: where, op_types: cu.op_types ?? [], start: at, seconds: seconds * share,
      cpu_seconds: cpuSeconds * share, bytes_in: bytesIn, bytes_out: bytesOut, bytes_from_other_devices: 0,
      resident_bytes: step.unit.residentBytes, ...ranFeatures(cu), ...(length > 1 ? { segment: length } : {}) };
    at += seconds * share * 1e3;
    return entry;
  });
}

/** What a request's trace is built from, read when it ends: `requestTrace` builds the trace from it
 * when `lastTrace` is first read, so that a request nobody inspects makes no trace objects.
 * @param {{policy: string, dag: string, outputs: string[], request: any, residentBytes: number, cacheStats: any,
 *          threads?: any}} what */
export function requestRecord(what) {
  const { activated, skipped, liveBytes, memory } = what.request;      // not its tensors, which the record must not keep
  return { ...what, request: { activated, skipped, liveBytes, memory }, maxrssMb: processMaxrssMb() };
}

/** @param {ReturnType<typeof requestRecord>} record */
export function requestTrace({ policy, dag, outputs, request, residentBytes, cacheStats, maxrssMb, threads }) {
  /** @type {any[]} */
  const entries = request.activated.flatMap((/** @type {any} */ a) => ("segment" in a ? segmentEntries(a) : [activationEntry(a)]));
  if (threads?.cu_thread) {        // CU workers: the thread that owns each CU ran it
    const t0 = entries.length ? entries[0].start : 0;
    for (const t of entries) [t.thread, t.start_ms] = [threads.cu_thread[t.cu] ?? 0, t.start - t0];
  }
  /** @type {Record<string, number>} */
  const byDevice = {};
  for (const t of entries) byDevice[t.device] = (byDevice[t.device] ?? 0) + 1;
  const t0 = entries.length ? entries[0].start : 0;
  return {
    ...header(policy, dag, outputs),
    activated_cus: entries.map((t) => t.cu),
    skipped_cus: [...request.skipped],
    approximated_cus: entries.filter((t) => "precision" in t).map((t) => ({ cu: t.cu, precision: t.precision, trust: t.trust })),
    fell_back_cus: [...entries.filter((t) => t.device !== "wasm").map((t) => ({ cu: t.cu, reason: FALLBACK_RUNTIME })),
      ...entries.filter((t) => "fell_back" in t).map((t) => ({ cu: t.cu, reason: t.fell_back }))],
    sandbox_stats: {
      cpu_time_ms: entries.reduce((n, t) => n + t.cpu_seconds, 0) * 1e3,
      peak_memory_mb: ((request.memory?.peak_resident_bytes ?? residentBytes) + request.liveBytes) / MB,
      peak_memory_basis: "loaded CUs + live tensors",
      process_maxrss_mb: maxrssMb,
      wasm_executions: entries.filter((t) => t.device === "wasm").length,
      ...NO_SANDBOX,
    },
    cache: cacheStats,
    memory: request.memory ?? null,      // null without memoryBudgetMB: every CU stays resident (js/src/residency.js)
    offline: null,
    cus_by_device: byDevice,
    total_seconds: entries.reduce((n, t) => n + t.seconds, 0),
    cus: entries.map(({ start, ...rest }) => rest),
    traceEvents: entries.map((t) => ({ name: t.cu, cat: t.op_types.join(","), ph: "X", pid: 0, tid: t.thread ?? 0,
      ts: (t.start - t0) * 1e3, dur: t.seconds * 1e6,
      args: { device: t.device, bytes_in: t.bytes_in, bytes_out: t.bytes_out } })),
    ...(threads ? { threads } : {}),
    // Each feature set whose modules ran, comma-joined: one per set an alternate build made an engine pick.
    wasm_features: [...new Set(entries.filter((t) => t.wasm_features).map((t) => t.wasm_features.join(",")))],
  };
}

/** The trace of a request the offline policy ran (`run`: what `SourceModel.run` reported), as
 * Python's `offline_trace`: no CUs; the peak memory is the process's where the engine tells it.
 * @param {{dag: string, outputs: string[], run: any}} what */
export function offlineTrace({ dag, outputs, run }) {
  const maxrss = processMaxrssMb();
  const { cpu_seconds: cpuSeconds, ...offline } = run;
  return {
    ...header("offline", dag, outputs),
    activated_cus: [], skipped_cus: [], approximated_cus: [], fell_back_cus: [],
    sandbox_stats: { cpu_time_ms: cpuSeconds * 1e3, peak_memory_mb: maxrss, peak_memory_basis: "process maxrss",
      process_maxrss_mb: maxrss, wasm_executions: 0, ...NO_SANDBOX },
    cache: null,
    memory: null,
    offline,
    cus_by_device: {},
    total_seconds: run.seconds,
    cus: [],
    traceEvents: [{ name: "source model", cat: "offline", ph: "X", pid: 0, tid: 0, ts: 0, dur: run.seconds * 1e6,
      args: { runtime: run.runtime, model: run.model } }],
  };
}
