// Reduced-precision variants at run time, with the Python runtime's rule and guards
// (cortex/runtime/variants.py): under a policy with a trust threshold, a CU runs its most compact
// variant (fewest artifact bytes; within 25% of the fewest, the cheapest to widen: int8, bf16, fp16;
// then by the precision's name) whose calibrated `trust`
// is at least the threshold; an uncalibrated variant (trust null) never runs. With the policy's
// guards on, an approximated CU's outputs are checked for NaN / Inf (unless the exact CU produced
// them during calibration) and against the calibrated range widened by a quarter of its span plus
// 1% of its largest magnitude; a violation reruns the exact CU, and the reason reads as Python's.
import { ARRAY_TYPES } from "./tensor.js";

export const GUARD_SPAN_MARGIN = 0.25;
export const EQUALLY_COMPACT = 0.25;
export const WIDENING_ORDER = ["int8", "bf16", "fp16"];
export const GUARD_MAGNITUDE_MARGIN = 0.01;

/** The name a variant is loaded under, as cortex/dag.py's `variant_id`. @param {string} id @param {string} precision */
export const variantId = (id, precision) => `${id}-${precision}`;

/** The CU record of one variant: the CU's interface with the variant's artifacts.
 * @param {import("./dag.js").CU} cu @param {string} precision @returns {import("./dag.js").CU} */
export function variantRecord(cu, precision) {
  return { ...cu, id: variantId(cu.id, precision), artifacts: /** @type {any} */ (cu.variants)[precision].artifacts };
}

/** The wasm records of every variant a CU holds. @param {import("./dag.js").CU} cu */
export function variantWasmRecords(cu) {
  return Object.values(cu.variants ?? {}).map((v) => v?.artifacts?.wasm).filter((r) => r !== undefined);
}

/** The precision the CU runs as under `threshold` (null: none, or exact CUs only), for a CU that
 * runs on the wasm device (fallback CUs have no variants). @param {import("./dag.js").CU} cu
 * @param {number|null} threshold @returns {string|null} */
export function chosenVariant(cu, threshold) {
  if (threshold === null || cu.runs_on !== undefined) return null;
  /** @type {[number, string][]} */
  const candidates = [];
  for (const [precision, variant] of Object.entries(cu.variants ?? {})) {
    const trust = variant?.trust, record = variant?.artifacts?.wasm;
    if (trust === null || trust === undefined || !(trust >= threshold) || record === undefined) continue;
    candidates.push([Number(record.bytes ?? record.weights?.bytes ?? 0), precision]);
  }
  if (candidates.length === 0) return null;
  const smallest = Math.min(...candidates.map(([bytes]) => bytes));
  const rank = (/** @type {string} */ p) => (WIDENING_ORDER.includes(p) ? WIDENING_ORDER.indexOf(p) : WIDENING_ORDER.length);
  const compact = candidates.filter(([bytes]) => bytes <= smallest * (1 + EQUALLY_COMPACT)).map(([, p]) => p);
  compact.sort((a, b) => rank(a) - rank(b) || (a < b ? -1 : a > b ? 1 : 0));
  return compact[0];
}

const FLOATS = new Set(["float32", "float64", "float16", "bfloat16"]);
const NUMBERS = new Set(Object.keys(ARRAY_TYPES).filter((t) => t !== "bool"));

/** Why an approximated CU's outputs cannot be used; null: they pass.
 * @param {import("./dag.js").CU} cu @param {Record<string, import("./tensor.js").Tensor>} outputs */
export function guardViolation(cu, outputs) {
  const ranges = cu.calibration?.outputs ?? {};
  for (const [name, tensor] of Object.entries(outputs)) {
    if (tensor.size === 0 || !NUMBERS.has(tensor.type)) continue;
    const observed = ranges[name] ?? {};
    const floating = FLOATS.has(tensor.type);
    const values = numbers(tensor);
    let min = Infinity, max = -Infinity, nonfinite = false;
    for (const v of values) {
      if (!Number.isFinite(v)) {
        nonfinite = true;
        continue;
      }
      if (v < min) min = v;
      if (v > max) max = v;
    }
    if (floating && !observed.nonfinite && nonfinite) return `${name} holds NaN or Inf`;
    const lo = observed.min, hi = observed.max;
    if (lo === undefined || lo === null || hi === undefined || hi === null) continue;
    const margin = GUARD_SPAN_MARGIN * (hi - lo) + GUARD_MAGNITUDE_MARGIN * Math.max(Math.abs(lo), Math.abs(hi));
    if (min <= max && (min < lo - margin || max > hi + margin)) {
      return `${name} spans [${formatG(min, 6)}, ${formatG(max, 6)}], outside its calibrated `
        + `range [${formatG(lo, 6)}, ${formatG(hi, 6)}] with margin ${formatG(margin, 3)}`;
    }
  }
  return null;
}

/** A tensor's elements as numbers (float16 and bfloat16 decoded from their words).
 * @param {import("./tensor.js").Tensor} tensor @returns {Iterable<number>} */
function numbers(tensor) {
  if (tensor.type === "float16") return Array.from(tensor.data, halfValue);
  if (tensor.type === "bfloat16") return Array.from(tensor.data, (/** @type {number} */ w) => new Float32Array(new Uint32Array([w << 16]).buffer)[0]);
  if (tensor.type === "int64" || tensor.type === "uint64") return Array.from(tensor.data, Number);
  return tensor.data;
}

/** @param {number} w an IEEE half's bits */
function halfValue(w) {
  const sign = w & 0x8000 ? -1 : 1, e = (w >> 10) & 0x1f, m = w & 0x3ff;
  if (e === 0x1f) return m ? NaN : sign * Infinity;
  return sign * (e === 0 ? m * 2 ** -24 : (1 + m / 1024) * 2 ** (e - 15));
}

/** Python's `format(x, ".Ng")`, so that a guard's reason reads the same in both runtimes.
 * @param {number} x @param {number} digits */
export function formatG(x, digits) {
  if (Number.isNaN(x)) return "nan";
  if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
  if (x === 0) return Object.is(x, -0) ? "-0" : "0";
  const [mantissa, exp] = x.toExponential(digits - 1).split("e");
  const exponent = Number(exp);
  const strip = (/** @type {string} */ s) => (s.includes(".") ? s.replace(/0+$/, "").replace(/\.$/, "") : s);
  if (exponent >= -4 && exponent < digits) return strip(x.toFixed(digits - 1 - exponent));
  const sign = exponent < 0 ? "-" : "+";
  return `${strip(mantissa)}e${sign}${String(Math.abs(exponent)).padStart(2, "0")}`;
}

/** @typedef {import("./scheduler.js").Unit} Unit */

/** Runs one CU as the policy allows: a guarded variant or the exact CU. Variants are loaded on
 * first use (`load`: those a policy picks, before the first request), so a per-request policy
 * may pick ones the session's policy did not. */
export class VariantRunner {
  /** @param {Map<string, import("./dag.js").CU>} cus @param {(cu: import("./dag.js").CU) => Promise<Unit>} loadUnit */
  constructor(cus, loadUnit) {
    this.cus = cus;
    this.loadUnit = loadUnit;
    /** @type {Map<string, Promise<Unit>>} variant id -> its unit */
    this.units = new Map();
    /** @type {Map<string, Unit>} the units that finished loading */
    this.loaded = new Map();
    /** @type {Map<number, Map<string, string | null>>} trust threshold -> each CU's pick (dag.json does not change) */
    this.choices = new Map();
  }

  /** @param {string} id @param {import("./policy.js").Policy} policy */
  choice(id, policy) {
    const threshold = policy.trustThreshold;
    if (threshold === null) return null;
    let picks = this.choices.get(threshold);
    if (picks === undefined) {
      picks = new Map([...this.cus].map(([cuId, cu]) => [cuId, chosenVariant(cu, threshold)]));
      this.choices.set(threshold, picks);
    }
    return /** @type {string | null} */ (picks.get(id) ?? null);
  }

  /** The variants `policy` picks, loaded. @param {import("./policy.js").Policy} policy */
  async load(policy) {
    await Promise.all([...this.cus.keys()].map((id) => {
      const precision = this.choice(id, policy);
      return precision === null ? undefined : this.unit(id, precision);
    }));
  }

  /** @param {string} id @param {string} precision @returns {Promise<Unit>} */
  unit(id, precision) {
    const key = variantId(id, precision);
    let unit = this.units.get(key);
    if (unit === undefined) {
      unit = this.loadUnit(variantRecord(/** @type {import("./dag.js").CU} */ (this.cus.get(id)), precision));
      unit.then((u) => this.loaded.set(key, u), () => this.units.delete(key));
      this.units.set(key, unit);
    }
    return unit;
  }

  get residentBytes() {
    let total = 0;
    for (const unit of this.loaded.values()) total += unit.residentBytes;
    return total;
  }

  /** The CU's outputs and what the trace says of it: {precision, trust} when a variant's outputs
   * were used, {fell_back: reason} when a guard reran the exact CU, {} otherwise.
   * @param {import("./dag.js").CU} cu @param {Unit} exact @param {Record<string, any>} inputs
   * @param {import("./policy.js").Policy} policy @returns {Promise<[Record<string, any>, Record<string, any>]>} */
  async run(cu, exact, inputs, policy) {
    const precision = this.choice(cu.id, policy);
    if (precision === null) return [await exact.run(inputs), {}];
    const unit = await this.unit(cu.id, precision);
    const results = await unit.run(inputs);
    const trust = /** @type {any} */ (cu.variants)[precision].trust;
    if (policy.guards) {
      const reason = guardViolation(cu, results);
      if (reason !== null) {
        return [await exact.run(inputs), { fell_back: `guard on the ${precision} variant: ${reason}; reran the exact CU` }];
      }
    }
    return [results, { precision, trust }];
  }
}
