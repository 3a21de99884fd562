// The checks on a request, worded as the Python runtime words them (cortex/runtime/loader.py):
// feeds by name, dtype and shape against dag.json's inputs; requested outputs by name.
import { CortexError, quoted } from "./errors.js";
import { Tensor } from "./tensor.js";

/** @param {number[]} shape */
const shapeText = (shape) => `[${shape.join(", ")}]`;

/** @param {any} feeds @param {import("./dag.js").TensorSpec[]} specs @returns {Record<string, Tensor>} */
export function checkedFeeds(feeds, specs) {
  if (typeof feeds !== "object" || feeds === null || Array.isArray(feeds) || feeds instanceof Tensor) {
    throw new CortexError("feeds must be an object of input name -> Tensor");
  }
  const expected = new Map(specs.map((s) => [s.name, s]));
  const unknown = Object.keys(feeds).filter((name) => !expected.has(name)).sort();
  if (unknown.length) {
    throw new CortexError(`unknown input ${unknown.map(quoted).join(", ")}: the model's inputs are `
      + `${[...expected.keys()].map(quoted).join(", ")}`);
  }
  /** @type {Record<string, Tensor>} */
  const checked = {};
  for (const [name, spec] of expected) {
    const value = feeds[name];
    if (value === undefined) throw new CortexError(`missing input ${quoted(name)} (${spec.dtype}${shapeText(spec.shape)})`);
    if (!(value instanceof Tensor) && !(value && typeof value.type === "string" && value.data && value.dims)) {
      throw new CortexError(`input ${quoted(name)} is not a Tensor`);
    }
    if (value.type !== spec.dtype) {
      throw new CortexError(`input ${quoted(name)} has dtype ${value.type}, the model expects ${spec.dtype}`);
    }
    if (value.dims.length !== spec.shape.length || value.dims.some((d, i) => d !== spec.shape[i])) {
      throw new CortexError(`input ${quoted(name)} has shape ${shapeText([...value.dims])}, the model expects ${shapeText(spec.shape)}`);
    }
    checked[name] = value instanceof Tensor ? value : new Tensor(value.type, value.data, value.dims);
  }
  return checked;
}

/** onnxruntime-web's `fetches`: a list of names or an object keyed by them; all outputs when absent.
 * @param {any} fetches @param {import("./dag.js").TensorSpec[]} specs @returns {string[]} */
export function requestedOutputs(fetches, specs) {
  const known = specs.map((s) => s.name);
  if (fetches === undefined || fetches === null) return known;
  const names = Array.isArray(fetches) ? fetches : typeof fetches === "object" ? Object.keys(fetches) : null;
  if (names === null || !names.every((n) => typeof n === "string")) {
    throw new CortexError("fetches must be a list of output names");
  }
  const unknown = names.filter((n) => !known.includes(n));
  if (unknown.length) {
    throw new CortexError(`unknown output ${unknown.map(quoted).join(", ")}: the model's outputs are ${known.map(quoted).join(", ")}`);
  }
  if (!names.length) throw new CortexError(`no outputs requested: name at least one of ${known.map(quoted).join(", ")}`);
  return [...new Set(names)];
}
