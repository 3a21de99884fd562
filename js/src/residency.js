// Memory tiers in the browser and Node, as the Python runtime keeps them (cortex/runtime/memory.py,
// residency.py; docs/runtime.md "memory tiers"). One wasm memory per CU is what lets a page give
// memory back: an instance nobody references is collected with its memory. Under `memoryBudgetMB`
// a CU is **resident** (instantiated, its weights in its memory) or **warm** (its module compiled
// and kept, so loading it again is one instantiation and its weights; no compile, no fetch of the
// module). The session's resident CUs, every section's together, hold at most the budget:
// - a CU's size is known before it loads: its planned memory in whole wasm pages (a split CU's
//   shared memory's pages), what `WasmUnit.residentBytes` reports once it is loaded; the bytes are
//   reserved before its load starts, so a load in flight already counts;
// - the least recently used CU is evicted first, never the CU about to run or a load in flight;
//   before it goes, each tensor in its memory that a later CU, a select or the caller still reads
//   is copied to the host, the others are dropped from the request (as Python does);
// - before the first CU and once each CU is resident, the CUs after it in dag.json's order that
//   are known to run (not `not needed`, no branch whose condition is undecided or picked the other
//   branch) are reserved while they fit next to it and handed to `WebAssembly.instantiate`, which
//   is asynchronous: they load at the awaits between CUs. While a prefetch is planned, the CUs
//   holding tensors still to be read are not evicted for it.
// Fallback CUs (onnxruntime-web) and variants stay outside the budget, as in Python.
// Scheduler hooks: each CU's unit is a `ResidentUnit` (the scheduler's Unit interface) that
// acquires its instance before it runs; `begin` and `finish` bracket a request.
import { copied } from "./cache.js";
import { CortexError } from "./errors.js";
import { formatG } from "./variants.js";

const MB = 2 ** 20;
const PAGE = 65536;
const END = Infinity;
// How far ahead the prefetch looks, in CUs (Python's LOOKAHEAD): within it only the budget bounds it.
const LOOKAHEAD = 64;

/** The budget in bytes (null: none, every CU resident). @param {unknown} mb */
export function budgetBytes(mb) {
  if (mb === undefined || mb === null) return null;
  if (typeof mb !== "number" || !Number.isFinite(mb) || mb <= 0) {
    throw new CortexError(`the memory budget (memoryBudgetMB) must be a positive number of MB (got ${JSON.stringify(mb)})`);
  }
  return Math.floor(mb * MB);
}

/** What a wasm CU holds once loaded: its planned memory in whole pages (at least one), or its
 * split build's shared memory. @param {import("./dag.js").CU} cu */
export function footprint(cu) {
  const plan = /** @type {any} */ (cu.artifacts?.wasm).memory;
  if (plan.threads) return plan.threads.pages * PAGE;
  return Math.max(1, Math.ceil(plan.memory_bytes / PAGE)) * PAGE;
}

/** Refuses, in Python's words, a budget the largest wasm CU does not fit.
 * @param {import("./dag.js").CU[]} cus @param {number} budget @param {string} where dag.json's URL */
export function checkBudget(cus, budget, where) {
  let largest = null, size = 0;
  for (const cu of cus) {
    if (cu.runs_on !== undefined) continue;
    const bytes = footprint(cu);
    if (bytes > size) [largest, size] = [cu, bytes];
  }
  if (largest !== null && budget < size) {
    throw new CortexError(`${where}: the memory budget (memoryBudgetMB) of ${formatG(budget / MB, 3)} MB is too small: `
      + `${largest.id} holds ${(size / MB).toFixed(2)} MB; give at least ${(size / MB).toFixed(2)} MB`);
  }
}

/** The session's resident CUs, least recently used first, with the bytes each holds (reserved
 * at its footprint before its load starts). Shared by every section's `Residency`. */
export class ResidentSet {
  /** @param {number} budget */
  constructor(budget) {
    this.budget = budget;
    /** @type {Map<ResidentUnit, number>} */
    this.resident = new Map();
    /** The most the set held since the request began. */
    this.peak = 0;
  }

  used() {
    let total = 0;
    for (const bytes of this.resident.values()) total += bytes;
    return total;
  }

  /** @param {ResidentUnit} unit @param {number} bytes */
  settle(unit, bytes) {
    this.resident.set(unit, bytes);
    this.peak = Math.max(this.peak, this.used());
  }

  /** @param {ResidentUnit} unit */
  touch(unit) {
    const bytes = /** @type {number} */ (this.resident.get(unit));
    this.resident.delete(unit);
    this.resident.set(unit, bytes);
  }

  /** The least recently used units whose eviction leaves `needed` bytes free, or null when
   * evicting every unit that may go is not enough. @param {number} needed @param {Set<ResidentUnit>} keep */
  victims(needed, keep) {
    let free = this.budget - this.used();
    const chosen = [];
    for (const [unit, bytes] of this.resident) {
      if (free >= needed) break;
      if (keep.has(unit) || unit.loading !== null) continue;
      chosen.push(unit);
      free += bytes;
    }
    return free >= needed ? chosen : null;
  }
}

/** One CU under the budget: the scheduler runs it as any unit; it is loaded when it must run. */
export class ResidentUnit {
  /** @param {import("./dag.js").CU} cu @param {number} position in dag.json's order @param {Residency} residency */
  constructor(cu, position, residency) {
    this.cu = cu;
    this.position = position;
    this.residency = residency;
    this.footprint = footprint(cu);
    /** The loaded unit, or null while warm. @type {import("./scheduler.js").Unit | null} */
    this.inner = null;
    /** Its load in flight. @type {Promise<void> | null} */
    this.loading = null;
  }

  get residentBytes() {
    return this.inner === null ? 0 : this.inner.residentBytes;
  }

  /** @param {Record<string, any>} inputs */
  async run(inputs) {
    await this.residency.acquire(this);
    try {
      return await /** @type {import("./scheduler.js").Unit} */ (this.inner).run(inputs);
    } finally {
      this.residency.afterRun(this);
    }
  }
}

/** @typedef {{budget_bytes: number, pinned_cus: string[], resident_bytes: number, peak_resident_bytes: number,
 *   bytes_loaded: number, bytes_evicted: number, loads: number, evictions: number, prefetch_hits: number,
 *   prefetch_misses: number, already_resident: number, wasted_bytes: number}} MemoryTrace */

/** One section's CUs under the session's `ResidentSet`: loads, prefetches and evicts. */
export class Residency {
  /** @param {ResidentSet} set @param {import("./dag.js").Dag} dag
   * @param {(cu: import("./dag.js").CU) => Promise<import("./scheduler.js").Unit>} load
   * @param {(unit: import("./scheduler.js").Unit) => Promise<void>} drop ends what a loaded unit runs besides its memory (workers) */
  constructor(set, dag, load, drop) {
    this.set = set;
    this.dag = dag;
    this.load = load;
    this.drop = drop;
    const position = new Map(dag.order.map((id, i) => [id, i]));
    /** @type {Map<string, ResidentUnit>} */
    this.units = new Map(dag.cus.filter((cu) => cu.runs_on === undefined)
      .map((cu) => [cu.id, new ResidentUnit(cu, /** @type {number} */ (position.get(cu.id)), this)]));
    /** The units in dag.json's order (null for a fallback CU's place). */
    this.inOrder = dag.order.map((id) => this.units.get(id) ?? null);
    /** tensor -> the position of its last reader (END: a select, condition or output reads it). */
    this.lastUse = new Map();
    dag.order.forEach((id, i) => {
      const cu = /** @type {import("./dag.js").CU} */ (dag.cus.find((c) => c.id === id));
      for (const name of [...cu.inputs, ...(cu.activation ? [cu.activation.tensor] : [])]) this.lastUse.set(name, i);
    });
    for (const s of dag.selects ?? []) for (const name of [s.tensor, s.condition, ...s.cases.map((c) => c.tensor)]) this.lastUse.set(name, END);
    for (const spec of dag.outputs) this.lastUse.set(spec.name, END);
    /** The request being run. @type {any} */
    this.request = null;
    /** The units running now (one, on a sequential walk). @type {Set<ResidentUnit>} */
    this.running = new Set();
    /** Units this request loaded -> bytes; those that ran. */
    /** @type {Map<ResidentUnit, number>} */ this.loaded = new Map();
    /** @type {Set<ResidentUnit>} */ this.ran = new Set();
    /** Units prefetched in this request whose turn has not come (a hit, landed or not). @type {Set<ResidentUnit>} */
    this.claimed = new Set();
    this.stats = freshStats();
  }

  /** A request starts: its counters, and the prefetch of its first CUs. @param {any} request */
  begin(request) {
    this.request = request;
    this.loaded.clear();
    this.ran.clear();
    this.claimed.clear();
    this.stats = freshStats();
    this.set.peak = this.residentBytes();
    this.prefetch(-1);
  }

  /** A request ends: no load left in flight; its trace's `memory`. @param {any} request */
  async finish(request) {
    await Promise.all([...this.set.resident.keys()].map((u) => u.loading?.catch(() => undefined)));
    const resident = this.residentBytes();
    let wasted = 0;
    for (const [unit, bytes] of this.loaded) if (!this.ran.has(unit)) wasted += bytes;
    request.memory = { budget_bytes: this.set.budget, pinned_cus: [], resident_bytes: resident,
      peak_resident_bytes: Math.max(this.set.peak, resident), ...this.stats, wasted_bytes: wasted };
    this.request = null;
  }

  /** What the loaded units hold now, every section's. */
  residentBytes() {
    let total = 0;
    for (const unit of this.set.resident.keys()) total += unit.residentBytes;
    return total;
  }

  /** `unit` loaded, for it is about to run; then the next CUs' prefetch. @param {ResidentUnit} unit */
  async acquire(unit) {
    this.running.add(unit);
    const prefetched = this.claimed.delete(unit) || unit.loading !== null;
    // A prefetch that failed (or a unit evicted before its turn) is loaded now: its own error, if
    // the load fails again, is the request's.
    if (unit.loading !== null) await unit.loading.catch(() => undefined);
    if (unit.inner !== null) {
      this.stats[prefetched ? "prefetch_hits" : "already_resident"] += 1;
    } else {
      this.stats.prefetch_misses += 1;
      await this.reserve(unit, true);
    }
    this.set.touch(unit);
    this.ran.add(unit);
    this.prefetch(unit.position);
  }

  /** What the unit holds after running (a module may grow its memory): evict others to fit. @param {ResidentUnit} unit */
  afterRun(unit) {
    this.running.delete(unit);
    if (unit.inner === null) return;
    this.set.settle(unit, unit.inner.residentBytes);
    const over = this.set.used() - this.set.budget;
    if (over > 0) for (const victim of this.set.victims(0, new Set([unit])) ?? []) this.evict(victim, unit.position);
    this.set.peak = Math.max(this.set.peak, this.residentBytes());
  }

  /** Reserve and start loading the CUs after `position` known to run, while they fit.
   * @param {number} position */
  prefetch(position) {
    const request = this.request;
    if (request === null) return;
    let room = this.set.budget;
    for (const unit of this.running) room -= unit.footprint;
    /** @type {ResidentUnit[]} */
    const window = [];
    for (let i = position + 1; i < this.inOrder.length && i <= position + LOOKAHEAD; i++) {
      const unit = this.inOrder[i];
      if (unit === null || !knownToRun(unit.cu, request)) continue;
      if (unit.footprint > room) break;
      room -= unit.footprint;
      window.push(unit);
    }
    const keep = new Set([...window, ...this.running, ...this.holding(position)]);
    for (const unit of window) {
      if (unit.inner !== null || unit.loading !== null) continue;
      const victims = this.set.victims(unit.footprint, keep);
      if (victims === null) break;
      for (const victim of victims) this.evict(victim, position + 1);
      this.start(unit);
      this.claimed.add(unit);
    }
  }

  /** The resident units whose memory holds a tensor the CU after `position` or a later one reads. @param {number} position */
  holding(position) {
    const byBuffer = new Map();
    for (const unit of this.set.resident.keys()) {
      const memory = /** @type {any} */ (unit.inner)?.memory;
      if (memory) byBuffer.set(memory.buffer, unit);
    }
    const held = [];
    for (const [name, tensor] of this.request.env) {
      const unit = byBuffer.get(tensor?.data?.buffer);
      if (unit !== undefined && (this.lastUse.get(name) ?? END) > position) held.push(unit);
    }
    return held;
  }

  /** Makes room for `unit` and loads it (settles with the load). `force`: the CU must run now, so loads in flight
   * may land and be evicted too (the budget holds the largest CU: `checkBudget`).
   * @param {ResidentUnit} unit @param {boolean} force */
  async reserve(unit, force) {
    const keep = new Set([...this.running, unit]);
    let victims = this.set.victims(unit.footprint, keep);
    while (victims === null && force) {
      const inFlight = [...this.set.resident.keys()].filter((u) => u.loading !== null && !keep.has(u));
      if (!inFlight.length) throw new CortexError(`${unit.cu.id}: ${unit.footprint} bytes do not fit the memory budget`);
      await Promise.all(inFlight.map((u) => u.loading?.catch(() => undefined)));
      victims = this.set.victims(unit.footprint, keep);
    }
    for (const victim of victims ?? []) this.evict(victim, unit.position);
    return this.start(unit);
  }

  /** Reserves the unit's bytes and starts its load, which it returns (a load that fails at once
   * has cleared `unit.loading` before a caller could await it). @param {ResidentUnit} unit */
  start(unit) {
    this.set.settle(unit, unit.footprint);
    this.stats.loads += 1;
    this.stats.bytes_loaded += unit.footprint;
    this.loaded.set(unit, (this.loaded.get(unit) ?? 0) + unit.footprint);
    unit.loading = this.load(unit.cu).then((inner) => {
      unit.inner = inner;
      unit.loading = null;
      if (this.set.resident.has(unit)) this.set.settle(unit, inner.residentBytes);
    }, (e) => {
      unit.loading = null;
      this.set.resident.delete(unit);       // a request that runs it loads it again
      throw e;
    });
    const loading = unit.loading;
    loading.catch(() => undefined);         // awaited by `acquire`; a prefetch nobody waits for fails quietly
    return loading;
  }

  /** Drops a loaded unit, back to warm; the request's tensors in its memory that are still read
   * are copied to the host first (the running CU took its inputs from the request before it
   * acquired: an evicted memory's buffer stays valid, only unreferenced, until they are copied into
   * its slots). @param {ResidentUnit} unit @param {number} position the next CU to run */
  evict(unit, position) {
    const inner = /** @type {any} */ (unit.inner);
    const request = this.request;
    if (request !== null && inner?.memory) {
      const buffer = inner.memory.buffer;
      const copies = new Map();
      for (const [name, tensor] of request.env) {
        if (tensor?.data?.buffer !== buffer) continue;
        if ((this.lastUse.get(name) ?? END) >= position) {
          if (!copies.has(tensor)) {
            copies.set(tensor, copied(tensor));
            request.liveBytes += tensor.data.byteLength;
          }
          request.env.set(name, copies.get(tensor));
        } else {
          request.env.delete(name);
        }
      }
    }
    this.claimed.delete(unit);
    this.stats.evictions += 1;
    this.stats.bytes_evicted += unit.residentBytes;
    unit.inner = null;
    this.set.resident.delete(unit);
    if (inner !== null) this.drop(inner).catch(() => undefined);
  }

  /** Every loaded unit dropped (release): nothing of a request is left to copy. */
  async clear() {
    await Promise.all([...this.units.values()].map((u) => u.loading?.catch(() => undefined)));
    for (const unit of this.units.values()) {
      if (unit.inner !== null) await this.drop(unit.inner);
      unit.inner = null;
      this.set.resident.delete(unit);
    }
  }
}

/** Whether a CU will run in this request, as far as can be told before its turn: it is needed,
 * and a branch CU's condition is computed and picks it. @param {import("./dag.js").CU} cu @param {any} request */
function knownToRun(cu, request) {
  if (request.needed !== null && !request.needed.has(cu.id)) return false;
  if (!cu.activation || !request.policy.skipInactive) return true;
  const condition = request.env.get(cu.activation.tensor);
  return condition !== undefined && Boolean(Number(condition.data[0])) === cu.activation.equals;
}

function freshStats() {
  return { bytes_loaded: 0, bytes_evicted: 0, loads: 0, evictions: 0, prefetch_hits: 0, prefetch_misses: 0,
    already_resident: 0 };
}
