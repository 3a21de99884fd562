// Residency (js/src/residency.js) on a dag of its own, with loads the test controls: a CU whose
// prefetch failed before its turn is loaded again at its turn, and what that load throws is the
// request's error (an engine refusing another instance, a weight file gone), not a unit missing.
import assert from "node:assert/strict";
import { test } from "node:test";
import { CortexError } from "../src/errors.js";
import { ResidentSet, Residency } from "../src/residency.js";

const PAGE = 65536;

/** A chain a -> b -> c of CUs of one page each. */
function chain() {
  const cu = (/** @type {string} */ id, /** @type {string} */ input, /** @type {string} */ output) => ({
    id, inputs: [input], outputs: [output], artifacts: { wasm: { memory: { memory_bytes: PAGE } } } });
  return { cus: [cu("a", "x", "p"), cu("b", "p", "q"), cu("c", "q", "y")], order: ["a", "b", "c"], outputs: [{ name: "y" }] };
}

/** A request's fields that Residency reads. */
const request = () => ({ needed: null, policy: { skipInactive: false }, env: new Map(), liveBytes: 0 });

test("a CU whose prefetch failed is loaded again at its turn, and that load's error is the request's", async () => {
  const loads = [];
  let refuse = 1;                 // b's first load is refused, as an engine out of memories refuses one
  const load = async (/** @type {any} */ cu) => {
    loads.push(cu.id);
    if (cu.id === "b" && refuse-- > 0) throw new CortexError("b cannot be instantiated: refused");
    return { cu, residentBytes: PAGE, run: () => ({ [cu.outputs[0]]: cu.id }) };
  };
  const residency = new Residency(new ResidentSet(3 * PAGE), chain(), load, async () => undefined);
  residency.begin(request());
  await new Promise((resolve) => setTimeout(resolve, 0));   // every prefetch has settled, b's refused
  assert.deepEqual(loads, ["a", "b", "c"]);
  const [a, b, c] = ["a", "b", "c"].map((id) => /** @type {any} */ (residency.units.get(id)));
  assert.deepEqual(await a.run({}), { p: "a" });
  assert.deepEqual(await b.run({}), { q: "b" }, "b is loaded again at its turn");
  assert.deepEqual(await c.run({}), { y: "c" });
  assert.deepEqual(loads, ["a", "b", "c", "b"]);

  // Refused at the prefetch and again at its turn: the request fails with the engine's words.
  const refusing = new Residency(new ResidentSet(3 * PAGE), chain(), async (/** @type {any} */ cu) => {
    if (cu.id === "b") throw new CortexError("b cannot be instantiated: refused");
    return { cu, residentBytes: PAGE, run: () => ({ [cu.outputs[0]]: cu.id }) };
  }, async () => undefined);
  refusing.begin(request());
  await new Promise((resolve) => setTimeout(resolve, 0));
  await /** @type {any} */ (refusing.units.get("a")).run({});
  await assert.rejects(() => /** @type {any} */ (refusing.units.get("b")).run({}),
    (e) => e instanceof CortexError && e.message === "b cannot be instantiated: refused");
});
