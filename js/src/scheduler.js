// Which CUs run, in dag.json's order, with the Python scheduler's semantics
// (cortex/runtime/scheduler.py, cortex/runtime/activation.py):
// - a branch CU of a decomposed If whose condition picks the other branch is skipped as
//   `inactive branch`; the If's outputs (selects) are the picked case's tensor once its CU ran;
// - a CU no requested output depends on is `not needed`;
// - a CU whose inputs are byte-identical to an earlier run's is a `cache hit`. Only CUs where a
//   hit is possible are keyed (hashed, looked up, stored): those dag.json marks `repeating`
//   (decompose --cache-inputs), and those whose every input already has a key in the request
//   (chained from a hit or a stored entry). A dag.json that marks nothing keys nothing;
// - `strict` skips nothing and caches nothing. Random CUs are never cached;
// - a CU the policy runs as a reduced-precision variant (js/src/variants.js) is never looked up
//   in the cache, whose keys name the exact CU's code.
// What a request does per CU is resolved once, at construction (`steps`), and what a policy and
// a set of outputs do once per pair (`plan`, js/src/plan.js): runs of CUs that need no decision
// from the host are segments, each one tight loop; the other CUs are walked one by one here. The
// hot path makes no promise, closure or trace object for a CU that runs synchronously: a strict
// request on wasm CUs awaits nothing, and its trace is built from plain numbers when it is first read.
import { cuKey, copied, outputKey, tensorKey } from "./cache.js";
import { RequestPlan, Segment, hitPossible, keyableCus } from "./plan.js";
import { clock, cpuClock } from "./trace.js";
import { VariantRunner } from "./variants.js";
import { WasmUnit } from "./wasm_unit.js";

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
    /** Whether CUs run on more than one device (then tensors are tracked to where they were written). */
    this.mixed = new Set(this.placement.values()).size > 1;
    const bytes = (/** @type {string[]} */ names) => names.reduce((n, name) => n + dag.tensors[name].bytes, 0);
    /** CU -> [select tensor, condition, value, case tensor] for each case it writes. */
    this.casesOf = new Map();
    /** case tensor -> the selects it may become */
    this.selectsOf = new Map();
    /** tensor -> the CUs that read it */
    this.readers = new Map();
    for (const cu of dag.cus) {
      for (const name of cu.inputs) {
        if (!this.readers.has(name)) this.readers.set(name, []);
        this.readers.get(name).push(cu.id);
      }
    }
    const producerOf = new Map(dag.cus.flatMap((cu) => cu.outputs.map((name) => [name, cu.id])));
    for (const s of dag.selects ?? []) {
      for (const c of s.cases) {
        const id = producerOf.get(c.tensor);
        if (!this.casesOf.has(id)) this.casesOf.set(id, []);
        this.casesOf.get(id).push([s.tensor, s.condition, c.equals, c.tensor]);
        if (!this.selectsOf.has(c.tensor)) this.selectsOf.set(c.tensor, []);
        this.selectsOf.get(c.tensor).push(s.tensor);
      }
    }
    /** @type {Step[]} one per CU, in dag.json's order */
    this.steps = dag.order.map((id) => {
      const cu = /** @type {import("./dag.js").CU} */ (this.cus.get(id));
      const where = /** @type {string} */ (this.placement.get(id));
      return { cu, id, where, unit: /** @type {Unit} */ (units.get(id)), bytesIn: bytes(cu.inputs), bytesOut: bytes(cu.outputs),
        inputBytes: cu.inputs.map((name) => dag.tensors[name].bytes), cases: this.casesOf.get(id) ?? null,
        identity: JSON.stringify([id, where, cu.sha256, cu.artifacts?.wasm ?? null]),
        bounded: [...(cu.artifacts?.wasm?.memory.inputs ?? []), ...(cu.artifacts?.wasm?.memory.outputs ?? [])]
          .some((entry) => entry.bound) };
    });
    /** @type {Map<string, RequestPlan>} (policy, requested outputs) -> its plan */
    this.plans = new Map();
    /** CU id -> keys of cache entries that are views of its output slots (given back before it runs again).
     * @type {Map<string, string[]>} */
    this.borrowed = new Map();
    /** Under a memory budget, what loads and evicts its units (js/src/residency.js). @type {import("./residency.js").Residency | null} */
    this.residency = null;
  }

  /** The plan of requests under `policy` for `outputs`, made on first use.
   * @param {import("./policy.js").Policy} policy @param {string[]} outputs */
  plan(policy, outputs) {
    const caching = policy.cache && this.cache.enabled;
    const key = JSON.stringify([policy.skipInactive, caching, policy.trustThreshold, outputs]);
    let plan = this.plans.get(key);
    if (plan !== undefined) return plan;
    const needed = policy.skipInactive ? this.needed(outputs) : null;
    const exact = (/** @type {Step} */ step) => policy.trustThreshold === null || this.variants.choice(step.id, policy) === null;
    const keyable = caching ? keyableCus(this.steps, (step) => !step.cu.random && exact(step), this.selectsOf) : new Set();
    const placedOnWasm = (/** @type {string} */ name) => {
      const producer = this.producer.get(name);
      return producer == null || this.placement.get(producer) === "wasm";
    };
    const joins = (/** @type {Step} */ step) => step.unit instanceof WasmUnit && !step.bounded && step.cases === null
      && (needed === null || needed.has(step.id)) && !(policy.skipInactive && step.cu.activation)
      && !keyable.has(step.id) && exact(step) && (!this.mixed || step.cu.inputs.every(placedOnWasm));
    const alwaysRead = new Set(outputs);
    for (const s of this.dag.selects ?? []) {
      alwaysRead.add(s.condition);
      for (const c of s.cases) alwaysRead.add(c.tensor);
    }
    for (const cu of this.dag.cus) if (cu.activation) alwaysRead.add(cu.activation.tensor);
    plan = new RequestPlan(this.steps, joins, this.readers, alwaysRead, needed);
    this.plans.set(key, plan);
    return plan;
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
    let liveBytes = 0;
    for (const name in feeds) liveBytes += feeds[name].data.byteLength;
    const plan = this.plan(policy, outputs);
    /** @type {Request} */
    const request = {
      policy,
      needed: plan.needed,
      env: new Map(Object.entries(feeds)),
      home: new Map(),
      keys: new Map(),
      activated: [],
      skipped: [],
      liveBytes,
    };
    const env = request.env;
    const caching = policy.cache && this.cache.enabled;
    if (this.residency !== null) this.residency.begin(request);
    for (const step of plan.items) {
      if (step instanceof Segment) {
        if (this.borrowed.size > 0) for (const s of step.steps) this.giveBack(s.id);
        step.run(request, this.mixed);
        continue;
      }
      const { cu, id } = step;
      /** @type {string | null} */
      let reason = null;
      /** @type {string | null} */
      let key = null;
      let hit;
      if (policy.skipInactive && cu.activation
          && conditionValue(env.get(cu.activation.tensor)) !== cu.activation.equals) {
        reason = INACTIVE;
      } else if (request.needed !== null && !request.needed.has(id)) {
        reason = NOT_NEEDED;
      } else if (caching && !cu.random && hitPossible(cu, request.keys) && this.variants.choice(id, policy) === null) {
        key = await this.cuKey(step, request);
        hit = this.cache.get(key);
        if (hit !== undefined) reason = CACHE_HIT;
      }
      if (reason === null) {
        if (this.borrowed.size > 0) this.giveBack(id);
        const running = this.runCu(step, request, key);
        if (running !== undefined) await running;
      } else {
        request.skipped.push({ cu: id, reason });
      }
      if (hit !== undefined) {
        for (const name in hit.outputs) {
          env.set(name, hit.outputs[name]);
          request.home.delete(name);
        }
        for (const name in hit.outputKeys) request.keys.set(name, hit.outputKeys[name]);
        request.liveBytes += hit.nbytes;
      }
      if (reason !== INACTIVE && step.cases !== null) {
        for (const [out, cond, equals, caseName] of step.cases) {
          if (conditionValue(env.get(cond)) !== equals) continue;
          env.set(out, env.get(caseName));
          if (request.home.has(caseName)) request.home.set(out, request.home.get(caseName));
          if (request.keys.has(caseName)) request.keys.set(out, /** @type {string} */ (request.keys.get(caseName)));
        }
      }
    }
    /** @type {Record<string, import("./tensor.js").Tensor>} */
    const results = {};
    for (const name of outputs) results[name] = copied(env.get(name));   // the caller's own
    if (this.residency !== null) await this.residency.finish(request);
    return { results, request };
  }

  /** The cache's views of a CU's output slots become host copies: the CU is about to run. @param {string} id */
  giveBack(id) {
    const keys = this.borrowed.get(id);
    if (keys === undefined) return;
    this.borrowed.delete(id);
    for (const key of keys) this.cache.materialize(key);
  }

  /** The cache key of a step's CU in this request: its identity and its inputs' keys.
   * @param {Step} step @param {Request} request */
  async cuKey(step, request) {
    const inputKeys = [];
    for (const name of step.cu.inputs) {
      let key = request.keys.get(name);
      if (key === undefined) {
        key = await tensorKey(request.env.get(name));
        request.keys.set(name, key);
      }
      inputKeys.push(key);
    }
    return cuKey(step.identity, inputKeys);
  }

  /** Runs a step's CU; a promise only when its unit or variant answers with one.
   * @param {Step} step @param {Request} request @param {string|null} key @returns {Promise<void> | undefined} */
  runCu(step, request, key) {
    const { cu, unit, where } = step;
    /** @type {Record<string, any>} */
    const inputs = {};
    let crossed = 0;                          // bytes another device's CU wrote, as in Python's trace
    for (let i = 0; i < cu.inputs.length; i++) {
      const name = cu.inputs[i];
      inputs[name] = request.env.get(name);
      if (this.mixed) {
        const home = request.home.get(name);
        if (home !== undefined && home !== where) crossed += step.inputBytes[i];
      }
    }
    const cpuStart = cpuClock();
    const start = clock();
    if (request.policy.trustThreshold === null || this.variants.choice(cu.id, request.policy) === null) {
      const results = unit.run(inputs);
      if (!(results instanceof Promise)) return this.ran(step, request, key, results, NO_VARIANT, start, cpuStart, crossed);
      return results.then((r) => this.ran(step, request, key, r, NO_VARIANT, start, cpuStart, crossed));
    }
    return this.variants.run(cu, unit, inputs, request.policy)
      .then(([results, variant]) => this.ran(step, request, key, results, variant, start, cpuStart, crossed));
  }

  /** Records a CU's run: its outputs in the request, the cache, and the numbers its trace entry is built from.
   * @param {Step} step @param {Request} request @param {string|null} key @param {Record<string, any>} results
   * @param {Record<string, any>} variant @param {number} start @param {number} cpuStart @param {number} crossed */
  ran(step, request, key, results, variant, start, cpuStart, crossed) {
    const seconds = (clock() - start) / 1000;
    const cpuSeconds = cpuClock() - cpuStart;
    for (const name in results) {
      request.env.set(name, results[name]);
      if (this.mixed) request.home.set(name, step.where);
    }
    request.liveBytes += step.bytesOut;
    if (key !== null) {
      // A wasm CU's outputs are views of its memory, unchanged until it runs again: stored as they are.
      const byReference = step.unit instanceof WasmUnit && !step.bounded && variant === NO_VARIANT;
      if (this.cache.fits(step.bytesOut) && this.cache.put(key, results, byReference) !== undefined && byReference) {
        const keys = this.borrowed.get(step.id);
        if (keys === undefined) this.borrowed.set(step.id, [key]); else keys.push(key);
      }
      for (const name in results) request.keys.set(name, outputKey(key, name));   // stored or not
    }
    request.activated.push({ step, start, seconds, cpuSeconds, crossed, residentBytes: step.unit.residentBytes, variant });
  }
}

/** What a trace entry adds for a CU that ran exactly. */
const NO_VARIANT = Object.freeze({});

/** @typedef {{cu: import("./dag.js").CU, id: string, where: string, unit: Unit, bytesIn: number, bytesOut: number,
 *             inputBytes: number[], cases: any[][] | null, identity: string, bounded: boolean}} Step */
/** @typedef {{step: Step, start: number, seconds: number, cpuSeconds: number, crossed: number, residentBytes: number,
 *             variant: Record<string, any>}} Activation */
/** @typedef {{policy: import("./policy.js").Policy, needed: Set<string> | null,
 *             env: Map<string, any>, home: Map<string, string>, keys: Map<string, string>,
 *             activated: (Activation | import("./plan.js").SegmentRun)[], skipped: {cu: string, reason: string}[], liveBytes: number,
 *             memory?: import("./residency.js").MemoryTrace}} Request
 *   `home`: tensor -> the device whose CU wrote it (absent: the host), kept only when devices are mixed. */
