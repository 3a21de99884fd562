// Which of a CU's modules an engine runs (js/src/features.js): the primary record when the engine
// has all its features, else the first alternate it has (compile-wasm --features
// "simd,relaxed-simd;simd"), as a record of its own with the alternate's plan and weights where it
// records them. Checked in this process (run with or without --experimental-wasm-relaxed-simd)
// and in a child Node without the flag, where Node 20 lacks relaxed SIMD.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { checkFeatures, recordedFeatures, runnableRecord } from "../src/features.js";

const FEATURES = path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "src", "features.js");
const PLAN = { memory_bytes: 65536, inputs: [], outputs: [] };
const OWN_PLAN = { memory_bytes: 131072, inputs: [], outputs: [] };

/** A record built for relaxed SIMD with a plain SIMD alternate (its own plan) and a scalar one. */
const relaxedRecord = () => ({
  path: "wasm-bin/cu-0000.wasm", sha256: "a".repeat(64), bytes: 10, memory: PLAN,
  options: { target: "wasm32-unknown-unknown", features: ["relaxed-simd", "simd"], opt_level: "3" },
  alternates: [{ features: ["simd"], path: "wasm-bin/cu-0000.simd.wasm", sha256: "b".repeat(64), bytes: 9, memory: OWN_PLAN },
    { features: [], path: "wasm-bin/cu-0000.scalar.wasm", sha256: "c".repeat(64), bytes: 8 }],
});

/** Whether this engine runs relaxed SIMD. */
function hasRelaxed() {
  try {
    checkFeatures(["relaxed-simd"], "probe");
    return true;
  } catch {
    return false;
  }
}

test("the engine runs the primary module when it has its features, else the first alternate it has", () => {
  const record = relaxedRecord();
  const chosen = /** @type {any} */ (runnableRecord(/** @type {any} */ (record)));
  assert.equal(runnableRecord(/** @type {any} */ (record)), chosen, "the same record object each time");
  assert.equal(chosen.alternates, undefined);
  if (hasRelaxed()) {
    assert.deepEqual([chosen.path, chosen.options.features, chosen.memory], [record.path, ["relaxed-simd", "simd"], PLAN]);
  } else {
    assert.deepEqual([chosen.path, chosen.sha256, chosen.bytes, chosen.options.features, chosen.memory],
      [record.alternates[0].path, "b".repeat(64), 9, ["simd"], OWN_PLAN]);
    assert.equal(chosen.options.opt_level, "3", "the other options are the primary's");
  }
  assert.deepEqual(recordedFeatures([record]), hasRelaxed() ? ["relaxed-simd", "simd"] : ["simd"]);
});

test("an alternate without a plan of its own has the primary's", () => {
  const record = relaxedRecord();
  record.alternates.shift();
  record.alternates.unshift({ features: ["simd"], path: "wasm-bin/cu-0000.simd.wasm", sha256: "b".repeat(64), bytes: 9 });
  const chosen = /** @type {any} */ (runnableRecord(/** @type {any} */ (record)));
  assert.equal(chosen.memory, PLAN);
});

test("without alternates the primary's lack is the one-line error it was", () => {
  const { alternates, ...record } = relaxedRecord();
  if (hasRelaxed()) {
    assert.equal(runnableRecord(/** @type {any} */ (record))?.path, record.path);
    return;
  }
  assert.equal(runnableRecord(/** @type {any} */ (record)), null);
  assert.deepEqual(recordedFeatures([record]), ["relaxed-simd", "simd"]);
  assert.throws(() => checkFeatures(recordedFeatures([record]), "dag.json"),
    /^CortexError: dag.json: the modules use WebAssembly relaxed-simd, which this engine lacks \(Node 20 needs/);
});

test("Node without --experimental-wasm-relaxed-simd picks the plain SIMD alternate", () => {
  const script = `import(${JSON.stringify(FEATURES)}).then(({ runnableRecord, checkFeatures }) => {
    try { checkFeatures(["relaxed-simd"], "probe"); console.log("has relaxed"); return; } catch {}
    const r = runnableRecord(${JSON.stringify(relaxedRecord())});
    console.log(JSON.stringify([r.path, r.options.features, r.memory.memory_bytes]));
  })`;
  const said = execFileSync(process.execPath, ["--input-type=module", "-e", script], { encoding: "utf8" }).trim();
  if (said === "has relaxed") return;         // a Node with relaxed SIMD on by default
  assert.deepEqual(JSON.parse(said), ["wasm-bin/cu-0000.simd.wasm", ["simd"], OWN_PLAN.memory_bytes]);
});
