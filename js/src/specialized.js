// A model compiled for several input shapes (cortex.dag/2): each request runs on the
// specialization whose input shapes match its feeds exactly, with the rule, the padding and the
// messages of the Python runtime (cortex/runtime/specialized.py).
//
// With `padToBucket` (a dim given to `--dim`, or an input given several `--input-shape`s), a
// request no specialization matches exactly is padded with `padValue` up to the nearest larger
// bucket along the axes that carry that dim, run there, and its outputs sliced back along theirs.
// An axis carries the dim when its extent equals the bucket's value in every specialization. That
// is only sound for models that ignore padded positions, so it is never done unasked.
import { CortexError } from "./errors.js";
import { bfloat16Bits, float16Bits } from "./examples.js";
import { ARRAY_TYPES, Tensor, elementCount } from "./tensor.js";

/** @typedef {import("./dag.js").Section} Section */

/** Python's shapes_text: `x=1x3x8x16 mask=1x8`, `scalar` for rank 0. @param {Record<string, readonly number[]>} shapes */
export function shapesText(shapes) {
  return Object.entries(shapes).map(([name, shape]) => `${name}=${shape.join("x") || "scalar"}`).join(" ");
}

/** @param {Section[]} sections */
export function compiledShapes(sections) {
  return sections.map((s) => `${s.name} (${shapesText(s.input_shapes)})`).join("; ");
}

/** @param {any} feeds @returns {Record<string, number[]>} each feed's dims, in the feeds' order */
export function feedShapes(feeds) {
  return Object.fromEntries(Object.entries(feeds).map(([name, t]) => [name, Array.isArray(t?.dims) || ArrayBuffer.isView(t?.dims)
    ? [...t.dims] : []]));
}

/** Whether two name -> shape maps are equal, as Python compares dicts (order aside). */
function sameShapes(/** @type {Record<string, number[]>} */ a, /** @type {Record<string, number[]>} */ b) {
  const names = Object.keys(a);
  return names.length === Object.keys(b).length && names.every((n) => n in b && a[n].length === b[n].length
    && a[n].every((d, k) => d === b[n][k]));
}

/** The index of the section whose input shapes are exactly `shapes`, or -1. @param {Section[]} sections @param {Record<string, number[]>} shapes */
export function exactSection(sections, shapes) {
  return sections.findIndex((s) => sameShapes(shapes, s.input_shapes));
}

export class Buckets {
  /** @param {Section[]} sections @param {string} name */
  constructor(sections, name) {
    this.name = name;
    if (sections.every((s) => name in s.dims)) {
      this.values = sections.map((s) => s.dims[name]);
    } else if (sections.every((s) => name in s.input_shapes)) {
      const shapes = sections.map((s) => s.input_shapes[name]);
      const varying = shapes[0].map((_, axis) => axis).filter((axis) => new Set(shapes.map((s) => s[axis])).size > 1);
      if (varying.length !== 1) {
        throw new CortexError(`--pad-to-bucket ${name}: its compiled shapes differ in ${varying.length} axes; padding needs exactly one`);
      }
      this.values = shapes.map((s) => s[varying[0]]);
    } else {
      const known = [...new Set([...sections.flatMap((s) => Object.keys(s.dims)), ...Object.keys(sections[0].input_shapes)])].sort();
      throw new CortexError(`--pad-to-bucket ${name}: not a dim or input of the specializations (they have ${known.join(", ")})`);
    }
    if (new Set(this.values).size < 2) {
      throw new CortexError(`--pad-to-bucket ${name}: it has one value in every specialization; nothing to pad`);
    }
    this.sections = sections;
    this.inputAxes = carryingAxes(sections, "inputs", this.values);
    this.outputAxes = carryingAxes(sections, "outputs", this.values);
  }

  /** The smallest bucket the inputs fit when padded, and their length along the dim.
   * @param {Record<string, number[]>} shapes @param {string} where dag.json @returns {[number, number]} */
  nearest(shapes, where) {
    const lengths = new Set(Object.entries(shapes).flatMap(([name, shape]) => (this.inputAxes.get(name) ?? [])
      .filter((axis) => axis < shape.length).map((axis) => shape[axis])));
    /** @type {[number, number, number][]} */
    const fits = [];
    if (lengths.size === 1) {
      const [length] = lengths;
      this.sections.forEach((section, i) => {
        const want = section.input_shapes;
        const names = Object.keys(want);
        if (Object.keys(shapes).length === names.length && names.every((n) => n in shapes) && length <= this.values[i]
            && names.every((n) => fitsBucket(shapes[n], want[n], this.inputAxes.get(n) ?? []))) {
          fits.push([this.values[i], i, length]);
        }
      });
    }
    if (!fits.length) {
      throw new CortexError(`no shape specialization matches or holds the inputs padded along ${this.name} `
        + `(${shapesText(shapes)}); ${where} was compiled for: ${compiledShapes(this.sections)}`);
    }
    fits.sort((a, b) => a[0] - b[0] || a[1] - b[1] || a[2] - b[2]);
    return [fits[0][1], fits[0][2]];
  }

  /** A feed padded with `value` up to section i's bucket. @param {string} name @param {Tensor} tensor @param {number} i @param {number} value */
  pad(name, tensor, i, value) {
    const axes = this.inputAxes.get(name) ?? [];
    // A feed of an unknown type is left for the section's own checks to refuse, by name.
    if (!axes.length || !ARRAY_TYPES[tensor?.type] || !ArrayBuffer.isView(tensor.data)) return tensor;
    const dims = tensor.dims.map((d, a) => (axes.includes(a) ? this.values[i] : d));
    const data = new ARRAY_TYPES[tensor.type](elementCount(dims));
    data.fill(/** @type {any} */ (padElement(tensor.type, value)));
    copyCorner(tensor.data, [...tensor.dims], data, dims, [...tensor.dims]);
    return new Tensor(tensor.type, data, dims);
  }

  /** An output sliced back to the request's length. @param {string} name @param {Tensor} tensor @param {number} length */
  slice(name, tensor, length) {
    const axes = this.outputAxes.get(name) ?? [];
    if (!axes.length) return tensor;
    const dims = tensor.dims.map((d, a) => (axes.includes(a) ? length : d));
    const data = new ARRAY_TYPES[tensor.type](elementCount(dims));
    copyCorner(tensor.data, [...tensor.dims], data, dims, dims);
    return new Tensor(tensor.type, data, dims);
  }
}

/** Per tensor, the axes whose extent is the bucket's value in every specialization.
 * @param {Section[]} sections @param {"inputs" | "outputs"} key @param {number[]} values @returns {Map<string, number[]>} */
function carryingAxes(sections, key, values) {
  const found = new Map();
  for (const { name } of sections[0].dag[key]) {
    const perSection = sections.map((s) => /** @type {import("./dag.js").TensorSpec} */ (s.dag[key].find((t) => t.name === name)).shape);
    if (new Set(perSection.map((s) => s.length)).size !== 1) continue;
    const axes = perSection[0].map((_, a) => a).filter((a) => perSection.every((s, k) => s[a] === values[k]));
    if (axes.length) found.set(name, axes);
  }
  return found;
}

/** @param {number[]} shape @param {number[]} bucket @param {number[]} axes */
function fitsBucket(shape, bucket, axes) {
  return shape.length === bucket.length && shape.every((d, a) => (axes.includes(a) ? d <= bucket[a] : d === bucket[a]));
}

/** numpy's `np.asarray(value).astype(dtype)` for one number. @param {string} type @param {number} value */
function padElement(type, value) {
  if (type === "bool") return value ? 1 : 0;
  if (type === "int64" || type === "uint64") return BigInt(Math.trunc(value));
  if (type === "float16") return value < 0 ? 0x8000 | float16Bits(-value) : float16Bits(value);
  if (type === "bfloat16") return bfloat16Bits(value);
  if (type.startsWith("float")) return value;
  return Math.trunc(value);
}

/** Copies the leading `extent` block of a row-major `source` (dims `from`) into `target` (dims `to`).
 * @param {any} source @param {number[]} from @param {any} target @param {number[]} to @param {number[]} extent */
function copyCorner(source, from, target, to, extent) {
  const rank = extent.length;
  if (rank === 0 || elementCount(extent) === 0) {
    if (rank === 0) target[0] = source[0];
    return;
  }
  const strides = (/** @type {number[]} */ dims) => dims.map((_, a) => elementCount(dims.slice(a + 1)));
  const [fromStrides, toStrides] = [strides(from), strides(to)];
  const row = extent[rank - 1];
  const index = new Array(rank - 1).fill(0);
  const rows = elementCount(extent.slice(0, -1));
  for (let r = 0; r < rows; r++) {
    let s = 0, t = 0;
    for (let a = 0; a < rank - 1; a++) { s += index[a] * fromStrides[a]; t += index[a] * toStrides[a]; }
    target.set(source.subarray(s, s + row), t);
    for (let a = rank - 2; a >= 0; a--) {
      if (++index[a] < extent[a]) break;
      index[a] = 0;
    }
  }
}
