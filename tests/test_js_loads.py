"""Loads in the JavaScript runtime (js/src/progress.js, js/src/module_cache.js): `create`'s onProgress
events arrive in order and end at the totals dag.json records; a second session compiles nothing
(Node: the in-process cache) and fetches no module (Chromium: the Cache API, on a fresh page of the
same browser profile) and gives the same outputs; a corrupted cache entry is fetched again, not an
error, whether or not it carries the header that marks the runtime's own (verified) entries; a bad
option is one line."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli
from js_cases import JS_DIR, NODE, compiled_case
from test_js_browser import CHROMIUM, QuietHandler
from test_js_node import external_weights_case
from test_js_threads_browser import served_browser
from testdata import sample_model

NODE_TIMEOUT_S = 300
PAGE_TIMEOUT_MS = 120_000

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def dag_of(case_json: Path) -> Path:
    case = json.loads(case_json.read_text())
    return (case_json.parent / case["dag"]).resolve()


def totals(dag: Path) -> tuple[int, int]:
    """(bytes, cus) create reads and loads under strict: every module and weight file once, every CU."""
    document = json.loads(dag.read_text())
    sizes = {}
    for cu in document["cus"]:
        record = cu["artifacts"]["wasm"]
        sizes[record["path"]] = record["bytes"]
        sizes.update({w["path"]: w["bytes"] for w in record.get("weights", [])})
    return sum(sizes.values()), len(document["cus"])


NODE_SCRIPT = """
import { InferenceSession, exampleFeeds } from %(index)s;
const dag = process.argv[2];
let compiles = 0;
for (const name of ["compile", "compileStreaming"]) {
  const original = WebAssembly[name];
  WebAssembly[name] = (...args) => { compiles += 1; return original.apply(WebAssembly, args); };
}
const outputs = async (s) => Object.fromEntries(Object.entries(await s.run(exampleFeeds(s.inputMetadata)))
  .map(([k, t]) => [k, Array.from(t.data)]));
const message = async (options) => {
  try { await InferenceSession.create(dag, options); return null; } catch (e) { return `${e.name}: ${e.message}`; }
};
const events = [];
const first = await InferenceSession.create(dag, { policy: "strict", onProgress: (e) => events.push({ ...e }) });
const firstCompiles = compiles;
const second = await InferenceSession.create(dag, { policy: "strict" });
const secondCompiles = compiles - firstCompiles;
const third = await InferenceSession.create(dag, { policy: "strict", moduleCache: false });
const uncachedCompiles = compiles - firstCompiles - secondCompiles;
let calls = 0;
const throwing = await message({ moduleCache: false, onProgress: () => { calls += 1; throw new Error("boom"); } });
console.log(JSON.stringify({ events, firstCompiles, secondCompiles, uncachedCompiles, throwing, throwingCalls: calls,
  badCallback: await message({ onProgress: 3 }), badCache: await message({ moduleCache: "yes" }),
  outputs: [await outputs(first), await outputs(second), await outputs(third)] }));
"""


def node_loads(dag: Path, tmp_path: Path) -> dict:
    script = tmp_path / "loads.mjs"
    script.write_text(NODE_SCRIPT % {"index": json.dumps((JS_DIR / "src" / "index.js").as_uri())})
    done = subprocess.run([NODE, str(script), str(dag)], capture_output=True, text=True, timeout=NODE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_in_order(events: list[dict], total_bytes: int, total_cus: int) -> None:
    assert events, "onProgress was never called"
    assert all(e["totalBytes"] == total_bytes and e["totalCus"] == total_cus for e in events), events[:3]
    for before, after in zip(events, events[1:]):
        assert after["bytes"] >= before["bytes"] and after["cus"] >= before["cus"], (before, after)
    assert all(e["bytes"] <= total_bytes and e["cus"] <= total_cus for e in events)
    assert events[-1]["bytes"] == total_bytes and events[-1]["cus"] == total_cus
    assert len(events) >= 1 + total_cus, events    # a call per CU at least, after some bytes


@pytest.mark.parametrize("case", ["mlp", "external-weights"])
def test_node_progress_ends_at_the_totals_and_a_second_session_compiles_nothing(tmp_path, case):
    listing = (compiled_case(sample_model("mlp"), "simd", min_cu_size=1, max_cu_depth=1) if case == "mlp"
               else external_weights_case())
    dag = dag_of(listing)
    result = node_loads(dag, tmp_path)
    total_bytes, total_cus = totals(dag)
    assert_in_order(result["events"], total_bytes, total_cus)
    modules = len({cu["artifacts"]["wasm"]["path"] for cu in json.loads(dag.read_text())["cus"]})
    assert result["firstCompiles"] == modules and result["secondCompiles"] == 0
    assert result["uncachedCompiles"] == modules           # moduleCache: false compiles again
    first, second, third = result["outputs"]
    assert first == second == third and first
    assert result["throwing"] == "CortexError: onProgress threw: boom" and result["throwingCalls"] == 1
    assert result["badCallback"] == ("CortexError: onProgress must be a function called with {bytes, totalBytes, "
                                     "cus, totalCus} (got number)")
    assert result["badCache"] == 'CortexError: moduleCache must be true or false (got "yes")'


class CountingHandler(QuietHandler):
    """Serves the site and records each path asked for (ThreadingHTTPServer: one list, appended)."""
    requested: list[str]

    def do_GET(self):
        self.requested.append(self.path.split("?")[0])
        super().do_GET()


@contextlib.contextmanager
def counted_visits(site: Path):
    """(origin, the paths asked for so far, a fresh Chromium browser context): `site` served from
    127.0.0.1 by a server that records each path a page asks for."""
    requested: list[str] = []
    handler = type("Counting", (CountingHandler,), {"requested": requested})
    with served_browser(site, handler) as (origin, browser):
        yield origin, requested, browser.new_context()

PAGE_CREATE = """async ([dag, corrupt, verifiedHeader]) => {
  const { InferenceSession, exampleFeeds } = await import("/cortex-runtime/index.js");
  if (corrupt) {          // a cached module's bytes replaced by a valid, other module's header
    const store = await caches.open("cortex-modules");
    const key = (await store.keys()).find((r) => r.url.includes(corrupt));
    // With verifiedHeader, the entry claims to be the runtime's own but its bytes are cut short.
    const bytes = verifiedHeader ? new Uint8Array((await (await store.match(key)).arrayBuffer()).slice(0, 100))
      : new Uint8Array([0, 97, 115, 109, 1, 0, 0, 0]);
    await store.put(key, new Response(bytes, { headers: { "content-type": "application/wasm",
      ...(verifiedHeader ? { "x-cortex-sha256": corrupt } : {}) } }));
  }
  const events = [];
  const started = performance.now();
  const session = await InferenceSession.create(dag, { policy: "strict", onProgress: (e) => events.push({ ...e }) });
  const createMs = performance.now() - started;
  const results = await session.run(exampleFeeds(session.inputMetadata));
  // Cache writes do not hold create up; the store is read once they have settled.
  await (await import("/cortex-runtime/module_cache.js")).pendingWrites();
  const store = await caches.open("cortex-modules");
  const cached = {};
  const verified = {};
  for (const request of await store.keys()) {
    const entry = await store.match(request);
    verified[request.url] = entry.headers.get("x-cortex-sha256");
    cached[request.url] = (await entry.arrayBuffer()).byteLength;
  }
  return { events, createMs, cached, verified,
           outputs: Object.fromEntries(Object.entries(results).map(([k, t]) => [k, Array.from(t.data)])) };
}"""


def test_chromium_caches_modules_between_pages_and_refetches_a_corrupt_entry(tmp_path):
    if not CHROMIUM.is_file():
        pytest.skip("chromium is not installed")
    dag = dag_of(compiled_case(sample_model("mlp"), "simd", min_cu_size=1, max_cu_depth=1))
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert code == 0, err
    (site / "blank.html").write_text("<!doctype html><title>loads</title>")
    document = json.loads((site / "dag.json").read_text())
    records = {cu["artifacts"]["wasm"]["path"]: cu["artifacts"]["wasm"] for cu in document["cus"]}
    total_bytes, total_cus = totals(site / "dag.json")

    def wasm_fetches() -> list[str]:
        fetched = [p.lstrip("/") for p in requested if p.endswith(".wasm")]
        requested.clear()
        return fetched

    with counted_visits(site) as (origin, requested, context):

        def visit(corrupt: str = "", verified_header: bool = False) -> list[dict]:
            page = context.new_page()
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(f"{origin}/blank.html")
            runs = [page.evaluate(PAGE_CREATE, [f"{origin}/dag.json", corrupt, verified_header])]
            runs.append(page.evaluate(PAGE_CREATE, [f"{origin}/dag.json", "", False]))     # the same page again
            page.close()
            return runs

        cold, same_page = visit()
        assert sorted(wasm_fetches()) == sorted(records)        # the cold visit fetched each module once
        warm, _ = visit()
        assert wasm_fetches() == []                            # a later visit: every module from the cache
        victim_path, victim = next(iter(records.items()))
        repaired, _ = visit(victim["sha256"])
        assert wasm_fetches() == [victim_path]                 # only the corrupted one, fetched again
        # An entry marked as the runtime's (not hashed again) whose bytes do not compile: fetched again.
        marked_corrupt, _ = visit(victim["sha256"], verified_header=True)
        assert wasm_fetches() == [victim_path]
    for run in (cold, same_page, warm, repaired, marked_corrupt):
        assert_in_order(run["events"], total_bytes, total_cus)
        assert run["outputs"] == cold["outputs"] and cold["outputs"]
    assert sorted(repaired["cached"].values()) == sorted(r["bytes"] for r in records.values())
    # Every entry was written by the runtime after its bytes matched: it names their sha256.
    by_sha = {r["sha256"]: r for r in records.values()}
    for verified in (cold["verified"], marked_corrupt["verified"]):
        assert sorted(verified.values()) == sorted(by_sha)
        assert all(f"sha256-{sha}.wasm" in url for url, sha in verified.items())
    print(f"\ncreate ms: cold {cold['createMs']:.1f}, same page {same_page['createMs']:.1f}, "
          f"next visit {warm['createMs']:.1f}, one entry corrupt {repaired['createMs']:.1f}")


def _weight_files(node) -> set[str]:
    """The weight files dag.json names, in any section ({path, offset, bytes, sha256} entries)."""
    if isinstance(node, dict):
        found = {node["path"]} if {"path", "offset", "bytes", "sha256"} <= node.keys() else set()
        return found.union(*(_weight_files(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_weight_files(v) for v in node))
    return set()


def test_chromium_keeps_weight_files_beside_the_modules_between_pages(tmp_path):
    if not CHROMIUM.is_file():
        pytest.skip("chromium is not installed")
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag_of(external_weights_case()), "--output", site])
    assert code == 0, err
    (site / "blank.html").write_text("<!doctype html><title>loads</title>")
    weights = _weight_files(json.loads((site / "dag.json").read_text()))
    assert weights

    def weight_fetches() -> set[str]:
        fetched = {p.lstrip("/") for p in requested} & weights
        requested.clear()
        return fetched

    with counted_visits(site) as (origin, requested, context):
        runs = []
        for _ in range(2):
            page = context.new_page()
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(f"{origin}/blank.html")
            runs.append(page.evaluate(PAGE_CREATE, [f"{origin}/dag.json", "", False]))
            page.close()
            if len(runs) == 1:
                assert weight_fetches() == weights        # the first visit read each file once
        assert weight_fetches() == set()                  # the second: every file from the cache
    first, second = runs
    assert first["outputs"] == second["outputs"] and first["outputs"]
    stored = {url: sha for url, sha in second["verified"].items() if url.endswith(".bin")}
    assert len(stored) == len(weights) and all(sha for sha in stored.values()), stored
