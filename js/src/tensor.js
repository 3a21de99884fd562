// Tensors as onnxruntime-web spells them: `new Tensor(type, data, dims)`, with its type strings.
// dag.json names dtypes as numpy does; they are the same strings for every type both know.
import { CortexError } from "./errors.js";

/** The typed array that holds each element type. float16 and bfloat16 are raw 16-bit words. */
export const ARRAY_TYPES = {
  float32: Float32Array, float64: Float64Array, int64: BigInt64Array, uint64: BigUint64Array,
  int32: Int32Array, uint32: Uint32Array, int16: Int16Array, uint16: Uint16Array, int8: Int8Array,
  uint8: Uint8Array, bool: Uint8Array, float16: Uint16Array, bfloat16: Uint16Array,
};

/** @param {number[]} dims */
export function elementCount(dims) {
  return dims.reduce((n, d) => n * d, 1);
}

export class Tensor {
  /**
   * @param {string} type one of ARRAY_TYPES' keys
   * @param {ArrayLike<number|bigint|boolean>} data a typed array of that type (used as is) or a plain array
   * @param {readonly number[]} [dims] the shape; a flat vector when absent
   */
  constructor(type, data, dims) {
    const ArrayType = ARRAY_TYPES[type];
    if (!ArrayType) {
      throw new CortexError(`unknown tensor type '${type}': expected one of ${Object.keys(ARRAY_TYPES).join(", ")}`);
    }
    if (Array.isArray(data)) {
      data = type === "bool" ? Uint8Array.from(data, Number)
        : ArrayType.from(/** @type {any[]} */ (data), ArrayType === BigInt64Array || ArrayType === BigUint64Array ? BigInt : Number);
    } else if (!(data instanceof ArrayType) && !(type === "float16" && isFloat16Array(data))) {
      throw new CortexError(`a '${type}' tensor needs a ${ArrayType.name} (got ${data?.constructor?.name ?? typeof data})`);
    }
    dims = dims === undefined ? [data.length] : [...dims];
    if (!dims.every((d) => Number.isInteger(d) && d >= 0)) {
      throw new CortexError(`tensor dims must be whole numbers, at least 0 (got [${dims.join(", ")}])`);
    }
    if (elementCount(dims) !== data.length) {
      throw new CortexError(`tensor data has ${data.length} elements, dims [${dims.join(", ")}] hold ${elementCount(dims)}`);
    }
    /** @type {string} */ this.type = type;
    /** @type {any} */ this.data = data;
    /** @type {readonly number[]} */ this.dims = dims;
    /** @type {number} */ this.size = data.length;
  }
}

/** @param {any} data */
function isFloat16Array(data) {
  return typeof globalThis.Float16Array === "function" && data instanceof globalThis.Float16Array;
}

/** The bytes of a tensor's data, without a copy. @param {{data: ArrayBufferView}} tensor */
export function bytesOf(tensor) {
  const { buffer, byteOffset, byteLength } = tensor.data;
  return new Uint8Array(buffer, byteOffset, byteLength);
}
