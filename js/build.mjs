// The runtime in one file per entry point, for pages: dist/cortex-runtime/index.js holds every module
// index.js imports (a page fetches one file instead of a level of imports per round trip, as
// onnxruntime-web ships ort.*.bundle.min.mjs), and each src/*_worker.js is bundled beside it under its
// own name, so `new URL("./cu_worker.js", import.meta.url)` finds it there. dist/cortex-runtime.json
// records the sha256 of every source the files were built from: `cortex bundle` adds the one-file
// form to a site (cortex-runtime/one-file/) only while that matches js/src. `make js-runtime` runs this;
// `node build.mjs DIR` writes DIR/cortex-runtime/ and DIR/cortex-runtime.json instead of dist/'s.
import { createHash } from "node:crypto";
import { readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { resolve } from "node:path";
import { build } from "esbuild";

const here = new URL(".", import.meta.url);
const src = new URL("src/", here);
const dist = process.argv[2] ? new URL(`${resolve(process.argv[2])}/`, "file:") : new URL("dist/", here);
const out = new URL("cortex-runtime/", dist);
const sources = readdirSync(src).filter((name) => name.endsWith(".js")).sort();
const entryPoints = ["index.js", ...sources.filter((name) => name.endsWith("_worker.js"))];

rmSync(out, { recursive: true, force: true });
await build({
  entryPoints: entryPoints.map((name) => new URL(name, src).pathname),
  outdir: out.pathname,
  bundle: true,
  format: "esm",
  platform: "neutral",
  target: "es2022",
  // Node's modules load only in Node; onnxruntime-web is imported by name, which the page maps.
  external: ["node:*", "onnxruntime-web"],
  minify: true,
  keepNames: true,
  legalComments: "none",
  logLevel: "warning",
});
const digests = Object.fromEntries(sources.map((name) =>
  [name, createHash("sha256").update(readFileSync(new URL(name, src))).digest("hex")]));
writeFileSync(new URL("cortex-runtime.json", dist),
  `${JSON.stringify({ entry_points: entryPoints, sources: digests }, null, 2)}\n`);
