// One compiled CU: its instance, and its inputs and outputs at the offsets of its memory plan
// (backends/wasm/memory_plan.py). Running is one copy in per input (a `set` from the producer's
// view, straight into this CU's slot), one call, and views of the outputs in the module's memory,
// valid until this CU runs again (the scheduler copies what it keeps). The slots and the output
// Tensors are made once per memory buffer (a module that grows its memory gets a new one), not
// per request.
// A bounded tensor (a data-dependent length, ir/bounds.py) comes in at its real shape, padded with
// zeros to its bound, and its real length is the int32 at the plan's `length_offset`.
import { CortexError } from "./errors.js";
import { ARRAY_TYPES, Tensor, bytesOf, elementCount } from "./tensor.js";

export class WasmUnit {
  /** Counts `bind`s of every unit: a request plan's segment remakes its views when it moved. */
  static generation = 0;

  /** @param {import("./dag.js").CU} cu @param {WebAssembly.Instance} instance */
  constructor(cu, instance) {
    this.cu = cu;
    this.plan = /** @type {import("./dag.js").WasmRecord} */ (cu.artifacts?.wasm).memory;
    const exports = /** @type {any} */ (instance.exports);
    if (!(exports.memory instanceof WebAssembly.Memory) || typeof exports.run !== "function") {
      throw new CortexError(`${cu.id}: its module does not export 'memory' and 'run'`);
    }
    /** @type {WebAssembly.Memory} */ this.memory = exports.memory;
    /** @type {() => void} */ this.call = exports.run;
    /** The buffer the slots and views below are on. @type {ArrayBuffer | null} */
    this.buffer = null;
    /** Each input's bytes in this memory (null for a bounded one, padded per request). @type {(Uint8Array | null)[]} */
    this.slots = [];
    /** The outputs, as `run` returns them; bounded ones are rebuilt per request. @type {Record<string, Tensor>} */
    this.outputs = {};
  }

  get residentBytes() {
    return this.memory.buffer.byteLength;
  }

  /** The memory's buffer now (a new one once the module grew its memory). */
  liveBuffer() {
    return this.memory.buffer;
  }

  /** The error a trap of this CU's `run` (or any error it throws) becomes. @param {any} error */
  failure(error) {
    return trapped(this.cu, error);
  }

  /** @param {ArrayBuffer} buffer */
  bind(buffer) {
    WasmUnit.generation += 1;
    this.buffer = buffer;
    this.slots = this.plan.inputs.map((entry) => (entry.bound ? null : new Uint8Array(buffer, entry.offset, entry.bytes)));
    /** @type {Record<string, Tensor>} */
    const outputs = {};
    for (const entry of this.plan.outputs) outputs[entry.name] = entry.bound ? /** @type {any} */ (null) : view(buffer, entry, entry.shape);
    this.outputs = outputs;
  }

  /** @param {Record<string, {type: string, data: ArrayBufferView, dims: readonly number[]}>} inputs
   *  @returns {Record<string, Tensor>} views of this CU's memory */
  run(inputs) {
    const buffer = this.liveBuffer();
    if (buffer !== this.buffer) this.bind(buffer);
    const entries = this.plan.inputs, slots = this.slots;
    for (let i = 0; i < entries.length; i++) {
      const entry = entries[i], tensor = inputs[entry.name], slot = slots[i];
      if (slot !== null) {
        slot.set(bytesOf(tensor));
      } else {
        const { length_offset: at } = /** @type {{length_offset: number}} */ (entry.bound);
        new Int32Array(buffer, at, 1)[0] = padInto(buffer, entry, tensor);
      }
    }
    try {
      this.call();
    } catch (e) {
      throw this.failure(e);
    }
    const after = this.liveBuffer();      // a module that grew its memory has a new buffer
    if (after !== this.buffer) this.bind(after);
    for (const entry of this.plan.outputs) if (entry.bound) this.outputs[entry.name] = realPart(after, entry);
    return this.outputs;
  }
}

/** The error a CU's trap (or any error its `run` throws) becomes. @param {import("./dag.js").CU} cu @param {any} e */
export function trapped(cu, e) {
  return new CortexError(`${cu.id} (${(cu.op_types ?? []).join(", ")}) trapped: ${e?.message ?? e}`);
}

/** @param {ArrayBuffer} buffer @param {import("./dag.js").PlanEntry} entry @param {number[]} shape */
function view(buffer, entry, shape) {
  const ArrayType = ARRAY_TYPES[entry.dtype];
  return new Tensor(entry.dtype, new ArrayType(buffer, entry.offset, elementCount(shape)), shape);
}

/** Rows of `axis` in a row-major shape: (outer count, bytes of one slot along axis). */
function layout(/** @type {number[]} */ shape, /** @type {number} */ axis, /** @type {number} */ itemBytes) {
  return [elementCount(shape.slice(0, axis)), elementCount(shape.slice(axis + 1)) * itemBytes];
}

/** @param {ArrayBuffer} buffer @param {import("./dag.js").PlanEntry} entry @param {{data: ArrayBufferView, dims: readonly number[]}} tensor */
function padInto(buffer, entry, tensor) {
  const axis = /** @type {{axis: number}} */ (entry.bound).axis;
  const bound = entry.shape[axis], length = tensor.dims[axis];
  const fits = tensor.dims.length === entry.shape.length && length <= bound
    && tensor.dims.every((d, k) => k === axis || d === entry.shape[k]);
  if (!fits) {
    throw new CortexError(`shape [${tensor.dims.join(", ")}] does not fit [${entry.shape.join(", ")}] bounded along axis ${axis}`);
  }
  const [outer, slot] = layout(entry.shape, axis, ARRAY_TYPES[entry.dtype].BYTES_PER_ELEMENT);
  const target = new Uint8Array(buffer, entry.offset, entry.bytes);
  const source = bytesOf(tensor);
  target.fill(0);
  for (let o = 0; o < outer; o++) target.set(source.subarray(o * length * slot, (o + 1) * length * slot), o * bound * slot);
  return length;
}

/** @param {ArrayBuffer} buffer @param {import("./dag.js").PlanEntry} entry */
function realPart(buffer, entry) {
  const { axis, length_offset } = /** @type {{axis: number, length_offset: number}} */ (entry.bound);
  const bound = entry.shape[axis], length = new Int32Array(buffer, length_offset, 1)[0];
  if (!(length >= 0 && length <= bound)) throw new CortexError(`a length of ${length} lies outside the bound ${bound}`);
  const shape = entry.shape.map((d, k) => (k === axis ? length : d));
  const ArrayType = ARRAY_TYPES[entry.dtype];
  const [outer, slot] = layout(entry.shape, axis, ArrayType.BYTES_PER_ELEMENT);
  if (outer === 1) return view(buffer, entry, shape);
  const padded = new Uint8Array(buffer, entry.offset, entry.bytes);
  const real = new Uint8Array(elementCount(shape) * ArrayType.BYTES_PER_ELEMENT);
  for (let o = 0; o < outer; o++) real.set(padded.subarray(o * bound * slot, o * bound * slot + length * slot), o * length * slot);
  return new Tensor(entry.dtype, new ArrayType(real.buffer), shape);
}
