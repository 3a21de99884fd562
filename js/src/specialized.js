// A model compiled for several input shapes or input values (cortex.dag/2): each request runs on
// the specialization whose input values (`--specialize`) equal its feeds' and whose input shapes
// match them exactly, with the rule, the padding and the messages of the Python runtime
// (cortex/runtime/specialized.py). An input specialised by value is checked and left out of the
// section's feeds: the section's build froze it.
//
// With `padToBucket` (a dim given to `--dim`, or an input given several `--input-shape`s), a
// request no specialization matches exactly is padded with `padValue` up to the nearest larger
// bucket along the axes that carry that dim, run there, and its outputs sliced back along theirs.
// An axis carries the dim when its extent equals the bucket's value in every specialization. That
// is only sound for models that ignore padded positions, so it is never done unasked.
import { CortexError } from "./errors.js";
import { bfloat16Bits, float16Bits } from "./examples.js";
import { checkedFeeds } from "./feeds.js";
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

/** The index of the section (of those `among`, default all) whose input shapes are exactly `shapes`, or -1.
 * @param {Section[]} sections @param {Record<string, number[]>} shapes @param {number[]} [among] */
export function exactSection(sections, shapes, among) {
  return (among ?? sections.map((_, i) => i)).find((i) => sameShapes(shapes, sections[i].input_shapes)) ?? -1;
}

/** The name, dtype and shape of each input the sections are specialised on by value: inputs the
 * build froze (`options.frozen_inputs`), which the caller still gives. @param {Section} section
 * @returns {import("./dag.js").TensorSpec[]} */
export function valueInputs(section) {
  const frozen = /** @type {any[]} */ (/** @type {any} */ (section.dag).options?.frozen_inputs ?? []);
  return Object.keys(section.input_values).map((name) => frozen.find((f) => f.name === name))
    .filter(Boolean).map((f) => ({ name: f.name, dtype: f.dtype, shape: f.shape }));
}

/** Python's values_text: `sr=8000` (a float as Python prints it, `1.0`; a bool `true`).
 * @param {Record<string, number | bigint | boolean>} values @param {Record<string, string>} [dtypes] */
export function valuesText(values, dtypes = {}) {
  return Object.entries(values).map(([name, v]) => `${name}=${typeof v === "number" && Number.isInteger(v)
    && dtypes[name]?.startsWith("float") ? v.toFixed(1) : String(v)}`).join(",");
}

/** The sections compiled for the values `feeds` give the inputs specialised by value (all, for
 * shape specializations only); a missing input, another dtype or shape, or a value not compiled is
 * one error, worded as in Python. @param {Section[]} sections @param {any} feeds @param {string} where
 * @returns {number[]} */
export function sectionsForValues(sections, feeds, where) {
  const specs = valueInputs(sections[0]);
  const all = sections.map((_, i) => i);
  if (!specs.length) return all;
  const given = Object.fromEntries(specs.filter((s) => s.name in feeds).map((s) => [s.name, feeds[s.name]]));
  const checked = checkedFeeds(given, specs);
  const dtypes = Object.fromEntries(specs.map((s) => [s.name, s.dtype]));
  const values = Object.fromEntries(specs.map((s) => [s.name, scalarOf(checked[s.name])]));
  const among = all.filter((i) => specs.every((s) => sections[i].input_values[s.name] === values[s.name]));
  if (!among.length) {
    const compiled = [...new Set(sections.map((s) => valuesText(s.input_values, dtypes)))].join("; ");
    throw new CortexError(`no value specialization matches the inputs (${valuesText(values, dtypes)}); ${where} `
      + `was compiled for: ${compiled}`);
  }
  return among;
}

/** A one-element tensor's value as dag.json's JSON holds it: a number (int64 as one when exact) or a bool.
 * @param {Tensor} tensor @returns {number | bigint | boolean} */
function scalarOf(tensor) {
  const value = tensor.data[0];
  if (tensor.type === "bool") return Boolean(value);
  if (typeof value === "bigint") return Number.isSafeInteger(Number(value)) ? Number(value) : value;
  if (tensor.type === "float16") return float16Value(/** @type {number} */ (value));
  return /** @type {number} */ (value);
}

/** The number an IEEE half's bits stand for. @param {number} bits */
function float16Value(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  if (exponent === 0) return sign * fraction * 2 ** -24;
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
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

  /** The smallest bucket (of the sections `among`, default all) the inputs fit when padded, and
   * their length along the dim.
   * @param {Record<string, number[]>} shapes @param {string} where dag.json @param {number[]} [among]
   * @returns {[number, number]} */
  nearest(shapes, where, among) {
    const lengths = new Set(Object.entries(shapes).flatMap(([name, shape]) => (this.inputAxes.get(name) ?? [])
      .filter((axis) => axis < shape.length).map((axis) => shape[axis])));
    /** @type {[number, number, number][]} */
    const fits = [];
    if (lengths.size === 1) {
      const [length] = lengths;
      this.sections.forEach((section, i) => {
        if (among && !among.includes(i)) return;
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
