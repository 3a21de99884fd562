// Fallback CUs (`runs_on: onnxruntime`, from `cortex decompose --fallback`): their cu.onnx runs on
// onnxruntime-web, the optional peer dependency, passed as `options.onnxruntime` or imported by name.
import { CortexError } from "./errors.js";
import { fileUrl, readBytes } from "./loader.js";
import { sha256Hex } from "./sha256.js";
import { Tensor } from "./tensor.js";

/** onnxruntime-web, given or imported. @param {any} given
 * @param {string} [what] what needs it, for the error */
export async function onnxruntimeWeb(given, what = "this model has fallback CUs (runs_on: onnxruntime), which need") {
  if (given) return given;
  const name = "onnxruntime-web";   // a variable, so that bundlers leave the optional import alone
  try {
    return await import(name);
  } catch {
    throw new CortexError(`${what} onnxruntime-web: install it, or pass it as InferenceSession.create(url, {onnxruntime: ort})`);
  }
}

export class OnnxruntimeUnit {
  /** @param {import("./dag.js").CU} cu @param {any} session an onnxruntime-web InferenceSession @param {any} ort */
  constructor(cu, session, ort) {
    this.cu = cu;
    this.session = session;
    this.ort = ort;
    this.residentBytes = 0;
  }

  /** @param {Record<string, Tensor>} inputs @returns {Promise<Record<string, Tensor>>} */
  async run(inputs) {
    /** @type {Record<string, any>} */
    const feeds = {};
    for (const name of this.cu.inputs) feeds[name] = new this.ort.Tensor(inputs[name].type, inputs[name].data, inputs[name].dims);
    const results = await this.session.run(feeds);
    /** @type {Record<string, Tensor>} */
    const outputs = {};
    for (const name of this.cu.outputs) outputs[name] = new Tensor(results[name].type, results[name].data, results[name].dims);
    return outputs;
  }
}

/** @param {import("./dag.js").CU} cu @param {URL} base @param {any} ort */
export async function loadFallbackUnit(cu, base, ort) {
  const url = fileUrl(base, cu.path, cu.id);
  const bytes = await readBytes(url);
  const sha = await sha256Hex(bytes);
  if (sha !== cu.sha256) {
    throw new CortexError(`${url.href}: sha256 ${sha} is not the ${cu.sha256} that dag.json records for ${cu.id}`);
  }
  const session = await ortSession(ort, bytes, `${cu.id}: onnxruntime-web cannot load ${url.href}`);
  return new OnnxruntimeUnit(cu, session, ort);
}

/** An onnxruntime-web session on a model's bytes, or one error starting with `refusal`.
 * @param {any} ort @param {Uint8Array} bytes @param {string} refusal */
export async function ortSession(ort, bytes, refusal) {
  try {
    return await ort.InferenceSession.create(bytes, { executionProviders: ["wasm"] });
  } catch (e) {
    // A model carries the IR version of the onnx package that wrote it, which may be newer than
    // the onnxruntime-web at hand supports; the model uses only what its opset allows, so it is
    // retried once declaring the newest IR version that onnxruntime-web names.
    const newest = /max supported IR version: (\d+)/.exec(String(/** @type {any} */ (e)?.message));
    if (!newest) throw new CortexError(`${refusal}: ${firstLine(e)}`);
    return ort.InferenceSession.create(withIrVersion(bytes, Number(newest[1])), { executionProviders: ["wasm"] })
      .catch((/** @type {any} */ again) => { throw new CortexError(`${refusal}: ${firstLine(again)}`); });
  }
}

/** @param {any} e */
export function firstLine(e) {
  return String(e?.message ?? e).split("\n")[0].split("ERROR_MESSAGE:").pop()?.trim();
}

/** The ModelProto with field 1 (ir_version, a varint; ONNX writers put it first) set to `version`.
 * @param {Uint8Array} bytes @param {number} version */
export function withIrVersion(bytes, version) {
  if (bytes[0] !== 0x08 || version > 127) return bytes;
  let end = 1;
  while (bytes[end] & 0x80) end += 1;
  const patched = new Uint8Array(bytes.length - (end + 1) + 2);
  patched.set([0x08, version]);
  patched.set(bytes.subarray(end + 1), 2);
  return patched;
}
