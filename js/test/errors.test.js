// Bad requests and bad files are one CortexError each, worded as the Python runtime words them.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { CortexError, InferenceSession, Tensor, exampleFeeds } from "../src/index.js";
import { SKIP, loadCases } from "../testing/cases.js";

const [first] = loadCases();
const skip = SKIP || (!first && "no cases");
const INDEX = fileURLToPath(new URL("../src/index.js", import.meta.url));

/** @param {() => Promise<unknown> | unknown} action @param {RegExp} message */
async function refuses(action, message) {
  await assert.rejects(async () => action(), (e) => e instanceof CortexError && message.test(e.message)
    || assert.fail(`${e?.name}: ${e?.message} does not match ${message}`));
}

/** A copy of the case's dag.json folder that a test may break. */
function copiedFolder() {
  const folder = mkdtempSync(path.join(tmpdir(), "cortex-js-"));
  cpSync(path.dirname(first.dag), folder, { recursive: true });
  return { folder, dag: path.join(folder, path.basename(first.dag)), done: () => rmSync(folder, { recursive: true }) };
}

test("bad feeds are refused with the Python runtime's messages", { skip }, async () => {
  const session = await InferenceSession.create(first.dag);
  const [spec] = session.inputMetadata;
  const feeds = exampleFeeds(session.inputMetadata);
  const shape = `[${spec.shape.join(", ")}]`;
  await refuses(() => session.run({ ...feeds, [spec.name]: undefined }), new RegExp(`^missing input '${spec.name}' \\(${spec.dtype}\\[`));
  await refuses(() => session.run({ ...feeds, nope: feeds[spec.name] }), /^unknown input 'nope': the model's inputs are '/);
  const wrongType = spec.dtype === "float64" ? "float32" : "float64";
  const n = spec.shape.reduce((a, b) => a * b, 1);
  await refuses(() => session.run({ ...feeds, [spec.name]: new Tensor(wrongType, new (wrongType === "float64" ? Float64Array : Float32Array)(n), spec.shape) }),
    new RegExp(`^input '${spec.name}' has dtype ${wrongType}, the model expects ${spec.dtype}$`));
  await refuses(() => session.run({ ...feeds, [spec.name]: new Tensor(spec.dtype, feeds[spec.name].data, [n]) }),
    new RegExp(`^input '${spec.name}' has shape \\[${n}\\], the model expects ${shape.replace(/[[\]]/g, "\\$&")}$`));
  await refuses(() => session.run(feeds, ["nope"]), /^unknown output 'nope': the model's outputs are '/);
  await refuses(() => session.run(feeds, []), /^no outputs requested: name at least one of '/);
  await refuses(() => session.run(feeds, { policy: "fast" }), /^unknown policy 'fast': expected one of strict, balanced, aggressive, offline$/);
  await refuses(() => session.run(null), /^feeds must be an object/);
  const outputs = await session.run(feeds);        // the session still serves after refusals
  assert.deepEqual(Object.keys(outputs), session.outputNames);
});

test("a Tensor whose data does not fill its dims is refused", () => {
  assert.throws(() => new Tensor("float32", new Float32Array(5), [2, 3]), /5 elements, dims \[2, 3\] hold 6/);
  assert.throws(() => new Tensor("float32", new Int32Array(6), [2, 3]), /needs a Float32Array/);
  assert.throws(() => new Tensor("complex64", [], [0]), /unknown tensor type 'complex64'/);
  assert.deepEqual([...new Tensor("int64", [1, 2], [2]).data], [1n, 2n]);
});

test("a tampered module is refused, naming the file and the CU", { skip }, async () => {
  const copy = copiedFolder();
  try {
    const dag = JSON.parse(readFileSync(copy.dag, "utf8"));
    const cu = dag.cus.find((/** @type {any} */ c) => c.artifacts?.wasm);
    const file = path.join(copy.folder, cu.artifacts.wasm.path);
    const bytes = readFileSync(file);
    bytes[bytes.length - 1] ^= 1;
    writeFileSync(file, bytes);
    // Without the module cache: a module this process compiled from the verified bytes earlier would
    // be served by its sha256, and the changed file never read.
    await refuses(() => InferenceSession.create(copy.dag, { moduleCache: false }),
      new RegExp(`${path.basename(file)}: sha256 [0-9a-f]{64} is not the ${cu.artifacts.wasm.sha256} that dag.json records for ${cu.id}`));
  } finally {
    copy.done();
  }
});

test("a missing dag.json, a foreign schema and a path outside the folder are refused", { skip }, async () => {
  await refuses(() => InferenceSession.create("/nonexistent/dag.json"), /^cannot read \/nonexistent\/dag.json: ENOENT/);
  const copy = copiedFolder();
  try {
    const dag = JSON.parse(readFileSync(copy.dag, "utf8"));
    writeFileSync(copy.dag, JSON.stringify({ ...dag, schema: "cortex.dag/0" }));
    await refuses(() => InferenceSession.create(copy.dag), /schema "cortex\.dag\/0" is not cortex\.dag\/1/);
    dag.cus[0].artifacts.wasm.path = "../../etc/passwd";
    writeFileSync(copy.dag, JSON.stringify(dag));
    await refuses(() => InferenceSession.create(copy.dag), new RegExp(`${dag.cus[0].id} names "\\.\\./\\.\\./etc/passwd", which lies outside its folder`));
    writeFileSync(copy.dag, "{");
    await refuses(() => InferenceSession.create(copy.dag), /not JSON/);
  } finally {
    copy.done();
  }
});

test("an engine without a feature the modules use is one error naming it", { skip }, () => {
  const relaxed = loadCases().find((c) => JSON.parse(readFileSync(c.dag, "utf8")).cus
    .some((/** @type {any} */ cu) => cu.artifacts?.wasm?.options.features.includes("relaxed-simd")));
  if (!relaxed) return;
  const script = `import(${JSON.stringify(INDEX)}).then(({ InferenceSession }) => InferenceSession.create(${JSON.stringify(relaxed.dag)}))`
    + ".then(() => console.log('loaded'), (e) => console.log(e.name + ': ' + e.message))";
  const said = execFileSync(process.execPath, ["--input-type=module", "-e", script], { encoding: "utf8" }).trim();
  if (said === "loaded") return;          // this Node has relaxed SIMD without a flag
  assert.match(said, /^CortexError: .*: the modules use WebAssembly relaxed-simd, which this engine lacks \(Node 20 needs --experimental-wasm-relaxed-simd/);
});
