// The `offline` policy, as cortex/runtime/offline.py runs it: no CUs, the source model that
// dag.json records (`source_model`, written by build-dag) on onnxruntime-web. It is the fallback
// for when the compiled modules cannot be trusted or loaded, so nothing here touches them.
// The source model usually lies outside dag.json's folder (a dag.json next to its build may name
// `../model.onnx`), so its path may climb out of that folder as in Python; what makes it safe to
// run is its sha256, checked against the bytes that the session is then built from. A bundle
// carries it only when written with `cortex bundle --with-source`.
import { SPECIALIZED_DAG_SCHEMA } from "./dag.js";
import { CortexError, quoted } from "./errors.js";
import { firstLine, ortSession } from "./fallback.js";
import { readBytes } from "./loader.js";
import { sha256Hex } from "./sha256.js";
import { Tensor } from "./tensor.js";
import { clock, cpuClock } from "./trace.js";

const REBUILD = "run 'cortex build-dag' again next to the model it was decomposed from (a bundle carries it "
  + "when written with 'cortex bundle --with-source')";

/** The source model's URL, checked before anything is read (an absolute path or another origin
 * is refused, a relative one may climb out of dag.json's folder). A cortex.dag/2 dag.json records
 * one source model for all its shape specializations (decompose --dim wrote them from one model,
 * which takes every compiled shape), so whichever section a request runs on, that model runs;
 * sections that name another one are refused, and frozen inputs are any section's.
 * @param {any} document dag.json @param {URL} url dag.json's URL @returns {{url: URL, path: string, sha256: string}} */
export function sourceModelRecord(document, url) {
  const bodies = document.schema === SPECIALIZED_DAG_SCHEMA && Array.isArray(document.specializations)
    ? document.specializations : [document];
  const record = document.source_model ?? bodies.find((b) => b?.source_model)?.source_model;
  if (record === undefined || record === null) {
    throw new CortexError(`${url.href}: records no source model, so the offline policy cannot run; ${REBUILD}`);
  }
  const other = bodies.find((b) => b?.source_model && (b.source_model.path !== record.path
    || b.source_model.sha256 !== record.sha256));
  if (other) {
    throw new CortexError(`${url.href}: specialization ${other.name} records another source model `
      + `(${JSON.stringify(other.source_model.path)}) than ${JSON.stringify(record.path)}; ${REBUILD}`);
  }
  const frozen = [...new Set(bodies.flatMap((b) => b?.options?.frozen_inputs ?? [])
    .map((/** @type {{name: string}} */ f) => f.name))];
  if (frozen.length) {
    throw new CortexError(`${url.href}: the CUs were built with --freeze-input ${frozen.join(", ")}; the source model `
      + "still takes those inputs, whose values dag.json does not hold, so the offline policy cannot run it");
  }
  const { path, sha256 } = record;
  if (typeof path !== "string" || !path || path.startsWith("/") || /^[a-z][a-z0-9+.-]*:/i.test(path)
      || typeof sha256 !== "string") {
    throw new CortexError(`${url.href}: source_model must be a relative path with its sha256 (got ${JSON.stringify(record)})`);
  }
  return { url: new URL(path, url), path, sha256 };
}

export class SourceModel {
  /** @param {{url: URL, path: string, sha256: string}} record @param {any} session @param {any} ort */
  constructor(record, session, ort) {
    this.record = record;
    this.session = session;
    this.ort = ort;
  }

  /** Reads, checks and opens the source model. @param {any} document dag.json @param {URL} url
   * @param {string[]} outputNames the outputs dag.json names @param {any} ort onnxruntime-web */
  static async open(document, url, outputNames, ort) {
    const record = sourceModelRecord(document, url);
    const where = record.url.href;
    let bytes;
    try {
      bytes = await readBytes(record.url);
    } catch {
      throw new CortexError(`${where}: the source model dag.json records is missing; ${REBUILD}`);
    }
    if (await sha256Hex(bytes) !== record.sha256) {
      throw new CortexError(`${where}: the source model changed since build-dag (its sha256 differs from `
        + `${url.href}'s); ${REBUILD}`);
    }
    const session = await ortSession(ort, bytes, `${where}: onnxruntime cannot load the source model`);
    const missing = outputNames.filter((name) => !session.outputNames.includes(name));
    if (missing.length) {
      throw new CortexError(`${where}: the source model has no output ${quoted(missing[0])}, which dag.json names`);
    }
    return new SourceModel(record, session, ort);
  }

  /** The requested outputs, and what the trace says of the run.
   * @param {Record<string, Tensor>} feeds @param {string[]} outputs */
  async run(feeds, outputs) {
    const where = this.record.url.href;
    /** @type {Record<string, any>} */
    const given = {};
    for (const name of this.session.inputNames) {
      const feed = feeds[name];
      if (feed === undefined) {
        throw new CortexError(`${where}: the source model needs input ${quoted(name)}, which dag.json does not list`);
      }
      given[name] = new this.ort.Tensor(feed.type, feed.data, feed.dims);
    }
    const cpuStart = cpuClock(), start = clock();
    let results;
    try {
      results = await this.session.run(given, outputs);
    } catch (e) {
      throw new CortexError(`${where}: onnxruntime failed on the source model: ${firstLine(e)}`);
    }
    const seconds = (clock() - start) / 1000, cpuSeconds = cpuClock() - cpuStart;
    /** @type {Record<string, Tensor>} */
    const got = {};
    for (const name of outputs) got[name] = new Tensor(results[name].type, results[name].data, results[name].dims);
    return { results: got, run: { model: this.record.path, sha256: this.record.sha256, runtime: "onnxruntime", seconds,
      cpu_seconds: cpuSeconds } };
  }
}
