// A request plan, as in the Python runtime (cortex/runtime/plan.py): for one dag (a section: its
// specialization), policy and set of requested outputs, what every request does, computed once.
// Most CUs need no decision from the host: they are not branch CUs whose condition the policy
// reads, nor CUs the result cache may key, nor CUs a variant replaces, nor fallback CUs, nor CUs
// with a bounded tensor (padded per request). A maximal run of such wasm CUs is a **segment**,
// run as one tight loop: per CU, the copies from its producers' output views into its input
// slots (`dst.set(src)`, paired once) and one call of its `run` export; no Map, no hash, no object
// per CU. Inputs from outside the segment (feeds, other steps' outputs) are written straight into
// the slots of the CUs that read them when the segment starts; what later steps, selects or the
// caller read is put in the request's tensors when it ends. Every other CU is a step of its own,
// walked by the scheduler as before. The trace gets one record per segment: its CUs' entries
// share its time out by their flops, as Python's do (a segment's CUs have no finer time).
import { clock, cpuClock } from "./trace.js";
import { WasmUnit } from "./wasm_unit.js";

export const REPEATING = "repeating";      // a CU's `cache` mark in dag.json (decompose --cache-inputs)

/** @typedef {import("./scheduler.js").Step} Step */

/** @typedef {{segment: Segment, start: number, seconds: number, cpuSeconds: number}} SegmentRun */

export class Segment {
  /** @param {Step[]} steps wasm CUs in dag.json's order @param {Set<string>} readOutside tensors read by
   *  anything but a CU of this segment (later steps, selects, conditions, the requested outputs) */
  constructor(steps, readOutside) {
    this.steps = steps;
    this.units = steps.map((s) => /** @type {WasmUnit} */ (s.unit));
    /** @type {(() => void)[]} each CU's `run` export (a CU whose kernel thread failed gets a new one) */
    this.calls = this.units.map((u) => u.call);
    /** The buffer each CU's views below are on. @type {(ArrayBuffer | null)[]} */
    this.buffers = this.units.map(() => null);
    const madeBy = new Map(steps.flatMap((s, i) => s.cu.outputs.map((name) => [name, i])));
    /** CU i's copies from earlier CUs of the segment are `copyFrom[i]` up to `copyFrom[i + 1]`:
     * [consumer, its input slot index, producer, the producer's output name] each. @type {[number, number, number, string][]} */
    this.links = [];
    this.copyFrom = [0];
    /** Inputs from outside the segment: [consumer, its input slot index, tensor name]. @type {[number, number, string][]} */
    this.outside = [];
    this.units.forEach((unit, i) => {
      unit.plan.inputs.forEach((entry, k) => {
        const producer = madeBy.get(entry.name);
        if (producer !== undefined && producer < i) this.links.push([i, k, producer, entry.name]);
        else this.outside.push([i, k, entry.name]);
      });
      this.copyFrom.push(this.links.length);
    });
    /** [producer, tensor name] of each output read outside. @type {[number, string][]} */
    this.exported = steps.flatMap((s, i) => s.cu.outputs.filter((name) => readOutside.has(name))
      .map((name) => /** @type {[number, string]} */ ([i, name])));
    this.exportNames = this.exported.map(([, name]) => name);
    this.outsideNames = this.outside.map(([, , name]) => name);
    this.bytesOut = steps.reduce((n, s) => n + s.bytesOut, 0);
    const flops = steps.map((s) => Number(s.cu.flops) || 0);
    const total = flops.reduce((a, b) => a + b, 0);
    /** Each CU's part of the segment's time. */
    this.shares = flops.map((f) => (total > 0 ? f / total : 1 / steps.length));
    /** The views, made by `refresh`. */
    /** @type {Uint8Array[]} */ this.dst = [];
    /** @type {Uint8Array[]} */ this.src = [];
    /** @type {Uint8Array[]} */ this.outsideSlots = [];
    /** @type {any[]} */ this.exportTensors = [];
    this.generation = -1;
  }

  /** The views of every CU's memory, remade after any memory got a new buffer (it grew, or a CU
   * got a new instance); in place, since `run` holds the arrays. */
  refresh() {
    const { units } = this;
    units.forEach((unit, i) => {
      const buffer = unit.liveBuffer();
      if (buffer !== unit.buffer) unit.bind(buffer);
      this.buffers[i] = unit.buffer;
      this.calls[i] = unit.call;
    });
    this.links.forEach(([i, k, p, name], c) => {
      this.dst[c] = /** @type {Uint8Array} */ (units[i].slots[k]);
      const { buffer, byteOffset, byteLength } = units[p].outputs[name].data;
      this.src[c] = new Uint8Array(buffer, byteOffset, byteLength);
    });
    this.outside.forEach(([i, k], c) => { this.outsideSlots[c] = /** @type {Uint8Array} */ (units[i].slots[k]); });
    this.exported.forEach(([p, name], c) => { this.exportTensors[c] = units[p].outputs[name]; });
    this.generation = WasmUnit.generation;
  }

  /** Runs the segment's CUs on the request's tensors; its outputs read outside join them.
   * @param {import("./scheduler.js").Request} request @param {boolean} mixed */
  run(request, mixed) {
    if (this.generation !== WasmUnit.generation) this.refresh();
    const env = request.env;
    const slots = this.outsideSlots, names = this.outsideNames;
    for (let k = 0; k < slots.length; k++) {
      const data = env.get(names[k]).data;
      slots[k].set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
    }
    const { calls, units, buffers, dst, src, copyFrom } = this;
    const n = calls.length;
    const cpuStart = cpuClock();
    const start = clock();
    let i = 0;
    try {
      for (; i < n; i++) {
        for (let c = copyFrom[i], end = copyFrom[i + 1]; c < end; c++) dst[c].set(src[c]);
        calls[i]();
        if (units[i].liveBuffer() !== buffers[i]) this.refresh();     // a module that grew its memory
      }
    } catch (e) {
      throw units[i].failure(e);
    }
    const seconds = (clock() - start) / 1000;
    const cpuSeconds = cpuClock() - cpuStart;
    const exportNames = this.exportNames, tensors = this.exportTensors;
    for (let k = 0; k < tensors.length; k++) {
      env.set(exportNames[k], tensors[k]);
      if (mixed) request.home.set(exportNames[k], "wasm");
    }
    request.liveBytes += this.bytesOut;
    request.activated.push(/** @type {SegmentRun} */ ({ segment: this, start, seconds, cpuSeconds }));
  }
}

/** The CUs a request under `caching` may key in the result cache: the ones marked repeating, and
 * those whose every input may have a key (chained from such a CU, through selects too). A superset
 * of what `hitPossible` keys in any request, so a segment never holds a CU the cache would key.
 * Mirrors Python's `keyable_cus`. @param {Step[]} steps @param {(step: Step) => boolean} cacheable
 * @param {Map<string, string[]>} selectsOf case tensor -> the selects it may become */
export function keyableCus(steps, cacheable, selectsOf) {
  const keyedTensors = new Set(), keyed = new Set();
  for (const step of steps) {
    const { cu } = step;
    if (!cacheable(step)) continue;
    if (cu.cache === REPEATING || (cu.inputs.length && cu.inputs.every((name) => keyedTensors.has(name)))) {
      keyed.add(cu.id);
      for (const name of [...cu.inputs, ...cu.outputs, ...cu.outputs.flatMap((o) => selectsOf.get(o) ?? [])]) {
        keyedTensors.add(name);
      }
    }
  }
  return keyed;
}

/** Whether keying `cu` in this request can pay: it is marked repeating, or every input already
 * has a key (a hit's or a stored entry's outputs, or hashed for another keyed CU). Inputs that
 * change with every request never hit; hashing them and storing the outputs costs more than a
 * light CU's run. @param {import("./dag.js").CU} cu @param {Map<string, string>} keys */
export function hitPossible(cu, keys) {
  if (cu.cache === REPEATING) return true;
  if (!cu.inputs.length) return false;
  for (const name of cu.inputs) if (!keys.has(name)) return false;
  return true;
}

/** What one (policy, requested outputs) does on a section, in dag.json's order: steps the scheduler
 * walks one by one, and segments. */
export class RequestPlan {
  /** @param {Step[]} steps every CU's step, in dag.json's order @param {(step: Step) => boolean} joins
   *  whether a CU may run inside a segment under this plan @param {Map<string, string[]>} readers tensor ->
   *  the CUs that read it @param {Set<string>} alwaysRead what selects, conditions and the caller read
   *  @param {Set<string> | null} needed */
  constructor(steps, joins, readers, alwaysRead, needed) {
    this.needed = needed;
    /** @type {Step[][]} */
    const runs = [];
    let open = false;
    for (const step of steps) {
      if (!joins(step)) {
        runs.push([step]);
        open = false;
      } else if (open) {
        runs[runs.length - 1].push(step);
      } else {
        runs.push([step]);
        open = true;
      }
    }
    /** @type {(Step | Segment)[]} */
    this.items = runs.map((run) => {
      if (!joins(run[0])) return run[0];
      const inRun = new Set(run.map((s) => s.id));
      const readOutside = new Set(run.flatMap((s) => s.cu.outputs).filter((name) => alwaysRead.has(name)
        || (readers.get(name) ?? []).some((id) => !inRun.has(id))));
      return new Segment(run, readOutside);
    });
  }
}
