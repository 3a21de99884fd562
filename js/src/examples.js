// The deterministic example inputs of `cortex run --example-inputs` and the test suites: floats
// arange(n) / n, integers and bools zero (always a valid index, mask or flag).
import { ARRAY_TYPES, Tensor, elementCount } from "./tensor.js";

/** @param {{name: string, dtype: string, shape: number[]}[]} specs the model's inputs (session.inputMetadata) */
export function exampleFeeds(specs) {
  /** @type {Record<string, Tensor>} */
  const feeds = {};
  for (const spec of specs) {
    const n = elementCount(spec.shape);
    const data = new ARRAY_TYPES[spec.dtype](n);
    const scale = Math.max(n, 1);
    if (spec.dtype === "float32" || spec.dtype === "float64") {
      for (let i = 0; i < n; i++) data[i] = i / scale;        // rounded once, from float64, as numpy does
    } else if (spec.dtype === "float16") {
      for (let i = 0; i < n; i++) data[i] = float16Bits(i / scale);
    } else if (spec.dtype === "bfloat16") {
      for (let i = 0; i < n; i++) data[i] = bfloat16Bits(i / scale);
    }
    feeds[spec.name] = new Tensor(spec.dtype, data, spec.shape);
  }
  return feeds;
}

/** IEEE half precision, round to nearest even; the examples lie in [0, 1). @param {number} x */
export function float16Bits(x) {
  if (x === 0) return 0;
  let exponent = Math.floor(Math.log2(x));
  if (2 ** exponent > x) exponent -= 1;                           // log2 may round across a power of two
  if (2 ** (exponent + 1) <= x) exponent += 1;
  if (exponent < -14) return roundEven(x / 2 ** -24);             // subnormal
  let bits = roundEven((x / 2 ** exponent - 1) * 1024);
  let e = exponent + 15;
  if (bits === 1024) { bits = 0; e += 1; }
  return (e << 10) | bits;
}

/** bfloat16: the top half of a float32, round to nearest even. @param {number} x */
export function bfloat16Bits(x) {
  const word = new Uint32Array(new Float32Array([x]).buffer)[0];
  return (word + 0x7fff + ((word >>> 16) & 1)) >>> 16;
}

/** @param {number} v */
function roundEven(v) {
  const r = Math.round(v);
  return Math.abs(v % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}
