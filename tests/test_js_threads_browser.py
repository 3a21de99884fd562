"""A `--wasm-features threads` bundle in headless Chromium (as tests/test_js_browser.py drives it):
on a crossOriginIsolated page (served with COOP/COEP headers) a session in a module Worker runs
the split CU on 1 and 2 threads (Web Workers running js/src/kernel_worker.js) with the bits of
Python's wasmtime run, and the page's main thread runs it on one thread and refuses two in one
line; a page that is not isolated refuses the build in one line at create."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli
from test_js_browser import CHROMIUM, CHROMIUM_ARGS, PAGE_TIMEOUT_MS, QuietHandler, playwright_api
from test_js_threads import THREADS, wasmtime_outputs
from test_js_threads import builds  # noqa: F401  (a fixture: pytest finds it by name)

pytestmark = pytest.mark.skipif(not CHROMIUM.is_file(), reason="chromium is not installed")

# Runs in a module Worker: one session per thread count, its output and trace posted back.
WORKER = """import { InferenceSession, Tensor } from "./cortex-runtime/index.js";
onmessage = async ({ data: { threads, x, shape } }) => {
  try {
    const session = await InferenceSession.create("./dag.json", { threads, policy: "strict" });
    const { y } = await session.run({ x: new Tensor("float32", new Float32Array(x), shape) });
    postMessage({ y: Array.from(y.data), threads: session.lastTrace.threads });
    await session.release();
  } catch (e) {
    postMessage({ error: String(e?.message ?? e) });
  }
};
"""

IN_WORKER = """async ([threads, x, shape]) => {
  const worker = new Worker("./threads_check.js", { type: "module" });
  const answer = await new Promise((resolve) => { worker.onmessage = (e) => resolve(e.data);
    worker.onerror = (e) => resolve({ error: String(e.message) }); worker.postMessage({ threads, x, shape }); });
  worker.terminate();
  return answer;
}"""

ON_MAIN_THREAD = """async ([threads, x, shape]) => {
  const { InferenceSession, Tensor } = await import("./cortex-runtime/index.js");
  try {
    const session = await InferenceSession.create("./dag.json", { threads, policy: "strict" });
    const { y } = await session.run({ x: new Tensor("float32", new Float32Array(x), shape) });
    return { y: Array.from(y.data), isolated: crossOriginIsolated };
  } catch (e) {
    return { error: String(e?.message ?? e), isolated: crossOriginIsolated };
  }
}"""


class IsolatedHandler(QuietHandler):
    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()


@contextlib.contextmanager
def served_browser(site: Path, handler):
    """(origin, a headless Chromium): `site` served from 127.0.0.1 by `handler` for the browser's life."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            try:
                yield f"http://127.0.0.1:{server.server_address[1]}", browser
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def opened_page(site: Path, isolated: bool, path: str, errors: list[str] | None = None):
    """A Chromium page at `path` of `site`, served from 127.0.0.1 isolated (COOP/COEP) or not; the
    page's uncaught errors go into `errors` from before it loads."""
    with served_browser(site, IsolatedHandler if isolated else QuietHandler) as (origin, browser):
        page = browser.new_page()
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        if errors is not None:
            page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{origin}/{path}")
        yield page


def evaluate(site: Path, isolated: bool, calls: list[tuple[str, list]]) -> list[dict]:
    """Each (script, argument) evaluated in a blank page of `site`, served isolated or not."""
    with opened_page(site, isolated, "blank.html") as page:
        return [page.evaluate(script, argument) for script, argument in calls]


def test_a_threads_bundle_runs_in_chromium_workers_and_is_refused_where_it_cannot(tmp_path, builds):
    dag, feeds = builds("matmul-rows", THREADS)
    (want,) = wasmtime_outputs(dag, feeds).values()
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert code == 0, err
    (site / "threads_check.js").write_text(WORKER)
    (site / "blank.html").write_text("<!doctype html><title>threads</title>")
    (x,) = feeds.values()
    argument = [x.ravel().tolist(), list(x.shape)]
    one, two, main_one, main_two = evaluate(site, True, [(IN_WORKER, [1, *argument]), (IN_WORKER, [2, *argument]),
                                                       (ON_MAIN_THREAD, [1, *argument]),
                                                       (ON_MAIN_THREAD, [2, *argument])])
    for threads, answer in ((1, one), (2, two)):
        assert "error" not in answer, answer["error"]
        assert answer["threads"]["kernel_threads"] == threads
        np.testing.assert_array_equal(np.array(answer["y"], dtype=np.float32).reshape(want.shape), want)
    assert main_one["isolated"] and "error" not in main_one, main_one
    np.testing.assert_array_equal(np.array(main_one["y"], dtype=np.float32).reshape(want.shape), want)
    assert "\n" not in main_two["error"] and "in a Worker" in main_two["error"], main_two
    (refused,) = evaluate(site, False, [(ON_MAIN_THREAD, [1, *argument])])
    assert not refused["isolated"]
    assert "\n" not in refused["error"] and "crossOriginIsolated" in refused["error"], refused
