// Which CUs run, in dag.json's order, with the Python scheduler's semantics
// (cortex/runtime/scheduler.py, cortex/runtime/activation.py):
// - a branch CU of a decomposed If whose condition picks the other branch is skipped as
//   `inactive branch`; the If's outputs (selects) are the picked case's tensor once its CU ran;
// - a CU no requested output depends on is `not needed`;
// - a CU whose inputs are byte-identical to an earlier run's is a `cache hit`;
// - `strict` skips nothing and caches nothing. Random CUs are never cached;
// - a CU the policy runs as a reduced-precision variant (js/src/variants.js) is never looked up
//   in the cache, whose keys name the exact CU's code.
import { cuKey, copied, outputKey, tensorKey } from "./cache.js";
import { clock, cpuClock } from "./trace.js";
import { VariantRunner } from "./variants.js";

export const INACTIVE = "inactive branch";
export const NOT_NEEDED = "not needed";
export const CACHE_HIT = "cache hit";

/** @param {import("./tensor.js").Tensor} tensor */
const conditionValue = (tensor) => Boolean(Number(tensor.data[0]));

/** @typedef {{run(inputs: Record<string, any>): Record<string, any> | Promise<Record<string, any>>, residentBytes: number}} Unit */

export class Scheduler {
  /** @param {import("./dag.js").Dag} dag @param {Map<string, Unit>} units @param {import("./cache.js").ResultCache} cache
   *  @param {(cu: import("./dag.js").CU) => Promise<Unit>} loadVariant */
  constructor(dag, units, cache, loadVariant) {
    this.dag = dag;
    this.units = units;
    this.cache = cache;
    this.cus = new Map(dag.cus.map((cu) => [cu.id, cu]));
    this.variants = new VariantRunner(this.cus, loadVariant);
    this.producer = new Map(Object.entries(dag.tensors).map(([name, t]) => [name, t.producer]));
    this.placement = new Map(dag.cus.map((cu) => [cu.id, cu.runs_on ?? "wasm"]));
    const bytes = (/** @type {string[]} */ names) => names.reduce((n, name) => n + dag.tensors[name].bytes, 0);
    this.traffic = new Map(dag.cus.map((cu) => [cu.id, [bytes(cu.inputs), bytes(cu.outputs)]]));
    this.identity = new Map(dag.cus.map((cu) => [cu.id, JSON.stringify([cu.id, this.placement.get(cu.id), cu.sha256,
      cu.artifacts?.wasm ?? null])]));
    /** CU -> [select tensor, condition, value, case tensor] for each case it writes. */
    this.casesOf = new Map();
    const producerOf = new Map(dag.cus.flatMap((cu) => cu.outputs.map((name) => [name, cu.id])));
    for (const s of dag.selects ?? []) {
      for (const c of s.cases) {
        const id = producerOf.get(c.tensor);
        if (!this.casesOf.has(id)) this.casesOf.set(id, []);
        this.casesOf.get(id).push([s.tensor, s.condition, c.equals, c.tensor]);
      }
    }
  }

  /** The CUs the tensors `outputs` depend on, through selects and activation conditions. @param {string[]} outputs */
  needed(outputs) {
    const selects = new Map((this.dag.selects ?? []).map((s) => [s.tensor, s]));
    const needed = new Set(), seen = new Set(), stack = [...outputs];
    while (stack.length) {
      const name = /** @type {string} */ (stack.pop());
      if (seen.has(name)) continue;
      seen.add(name);
      const select = selects.get(name);
      if (select) stack.push(select.condition, ...select.cases.map((c) => c.tensor));
      const producer = this.producer.get(name);
      if (producer != null && !needed.has(producer)) {
        needed.add(producer);
        const cu = /** @type {import("./dag.js").CU} */ (this.cus.get(producer));
        stack.push(...cu.inputs);
        if (cu.activation) stack.push(cu.activation.tensor);
      }
    }
    return needed;
  }

  residentBytes() {
    let total = 0;
    for (const unit of this.units.values()) total += unit.residentBytes;
    return total + this.variants.residentBytes;
  }

  /** @param {Record<string, import("./tensor.js").Tensor>} feeds @param {import("./policy.js").Policy} policy @param {string[]} outputs */
  async run(feeds, policy, outputs) {
    const request = {
      policy,
      needed: policy.skipInactive ? this.needed(outputs) : null,
      env: new Map(Object.entries(feeds)),
      /** @type {Map<string, string>} tensor -> the device whose CU wrote it (absent: the host) */ home: new Map(),
      /** @type {Map<string, string>} */ keys: new Map(),
      /** @type {any[]} */ activated: [],
      /** @type {{cu: string, reason: string}[]} */ skipped: [],
      liveBytes: Object.values(feeds).reduce((n, t) => n + t.data.byteLength, 0),
    };
    for (const id of this.dag.order) {
      const cu = /** @type {import("./dag.js").CU} */ (this.cus.get(id));
      const [reason, key, hit] = await this.skipReason(cu, request);
      if (reason === null) {
        await this.runCu(cu, request, key);
      } else {
        request.skipped.push({ cu: id, reason });
      }
      if (reason === CACHE_HIT) {
        for (const [name, tensor] of Object.entries(hit.outputs)) {
          request.env.set(name, tensor);
          request.home.delete(name);
        }
        for (const [name, k] of Object.entries(hit.outputKeys)) request.keys.set(name, k);
        request.liveBytes += hit.nbytes;
      }
      if (reason !== INACTIVE) {
        for (const [out, cond, equals, caseName] of this.casesOf.get(id) ?? []) {
          if (conditionValue(request.env.get(cond)) !== equals) continue;
          request.env.set(out, request.env.get(caseName));
          if (request.home.has(caseName)) request.home.set(out, request.home.get(caseName));
          if (request.keys.has(caseName)) request.keys.set(out, /** @type {string} */ (request.keys.get(caseName)));
        }
      }
    }
    /** @type {Record<string, import("./tensor.js").Tensor>} */
    const results = {};
    for (const name of outputs) results[name] = copied(request.env.get(name));   // the caller's own
    return { results, request };
  }

  /** Why `cu` does not run in this request (null: it runs), the cache key it has, and the entry on a hit.
   * @param {import("./dag.js").CU} cu @param {any} request @returns {Promise<[string|null, string|null, any]>} */
  async skipReason(cu, request) {
    if (request.policy.skipInactive && cu.activation
        && conditionValue(request.env.get(cu.activation.tensor)) !== cu.activation.equals) {
      return [INACTIVE, null, null];
    }
    if (request.needed !== null && !request.needed.has(cu.id)) return [NOT_NEEDED, null, null];
    if (request.policy.cache && this.cache.enabled && !cu.random && this.variants.choice(cu.id, request.policy) === null) {
      const inputKeys = [];
      for (const name of cu.inputs) inputKeys.push(await this.tensorKey(name, request));
      const key = await cuKey(/** @type {string} */ (this.identity.get(cu.id)), inputKeys);
      const hit = this.cache.get(key);
      if (hit !== undefined) return [CACHE_HIT, key, hit];
      return [null, key, null];
    }
    return [null, null, null];
  }

  /** @param {string} name @param {any} request */
  async tensorKey(name, request) {
    let key = request.keys.get(name);
    if (key === undefined) {
      key = await tensorKey(request.env.get(name));
      request.keys.set(name, key);
    }
    return key;
  }

  /** @param {import("./dag.js").CU} cu @param {any} request @param {string|null} key */
  async runCu(cu, request, key) {
    const unit = /** @type {Unit} */ (this.units.get(cu.id));
    /** @type {Record<string, any>} */
    const inputs = {};
    const where = this.placement.get(cu.id);
    let crossed = 0;                          // bytes another device's CU wrote, as in Python's trace
    for (const name of cu.inputs) {
      inputs[name] = request.env.get(name);
      const home = request.home.get(name);
      if (home !== undefined && home !== where) crossed += this.dag.tensors[name].bytes;
    }
    const cpuStart = cpuClock();
    const start = clock();
    const [results, variant] = await this.variants.run(cu, unit, inputs, request.policy);
    const seconds = (clock() - start) / 1000;
    const cpuSeconds = cpuClock() - cpuStart;
    for (const [name, tensor] of Object.entries(results)) {
      request.env.set(name, tensor);
      request.home.set(name, /** @type {string} */ (where));
    }
    const [bytesIn, bytesOut] = /** @type {number[]} */ (this.traffic.get(cu.id));
    request.liveBytes += bytesOut;
    if (key !== null) {
      if (this.cache.fits(bytesOut)) this.cache.put(key, results);
      for (const name of Object.keys(results)) request.keys.set(name, outputKey(key, name));   // stored or not
    }
    request.activated.push({ cu: cu.id, device: where, op_types: cu.op_types ?? [], start, seconds,
      cpu_seconds: cpuSeconds, bytes_in: bytesIn, bytes_out: bytesOut, bytes_from_other_devices: crossed,
      resident_bytes: unit.residentBytes, ...variant });
  }
}
