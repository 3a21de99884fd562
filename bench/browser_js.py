"""`make bench-js`'s Chromium half (bench/bench_js.py calls it per model): Cortex's JavaScript runtime
and onnxruntime-web in Debian's headless Chromium, driven by playwright, on pages served from
127.0.0.1 by a threaded http.server, once plain and once with COOP/COEP headers (crossOriginIsolated).
The page side is bench/browser/ (harness.js, on a page's main thread or in a module Worker).

Contestants, alternating run by run (wall time per `session.run`; a page has no CPU clock):
- one thread each on the plain page's main thread: Cortex's default build, onnxruntime-web numThreads 1;
- Cortex `numThreads: 2` on the plain page (independent CUs on Workers, no SharedArrayBuffer) on a
  `--parallel 2` build of the model (its large contractions sliced into 2 independent CUs: a default
  build is a chain of CUs, which the workers cannot run at once), against onnxruntime-web numThreads 2,
  which needs isolation: in a Worker of the isolated page;
- on the isolated page, both in Workers: Cortex's `--wasm-features threads` build under `threads: 2`
  (its kernels in parts on 2 threads), against the same onnxruntime-web numThreads 2.
Loads: runtime import + create + first result on a fresh browser context (cold: nothing cached) and
on a second page of that context (warm: Cortex's modules from the Cache API, onnxruntime-web's files
from the http cache). Memory: the page renderer's RSS before create, after the first run and after
`session.release()`, collected first, in a Chromium with no DevTools client (bench/chromium_memory.py),
for Cortex on the page's thread and proxied (`proxy: true`: in a Worker that release() ends)."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import statistics
import tempfile
import threading
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench import chromium_memory
from bench.node_runner import ORTWEB_DIR

CHROMIUM = Path("/usr/bin/chromium")
HARNESS_DIR = Path(__file__).resolve().parent / "browser"
# --expose-gc lets the harness collect garbage before a load is timed.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--js-flags=--expose-gc",
                 "--disable-background-timer-throttling",
                 "--disable-renderer-backgrounding", "--disable-backgrounding-occluded-windows"]
PAGE_TIMEOUT_MS = 300_000
MEMORY_TIMEOUT_S = 300
THREADS = 2


class BrowserUnavailable(RuntimeError):
    pass


@contextmanager
def served(folder: Path, isolated: bool):
    """The origin of an http.server on 127.0.0.1 serving `folder` (with COOP/COEP when `isolated`)."""
    handler = functools.partial(chromium_memory.IsolatedHandler if isolated else chromium_memory.QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def prepare_site(site: Path, feeds_described: list[dict]) -> list[dict]:
    """Adds the harness (bench/), onnxruntime-web's dist (ortweb/) and the inputs (inputs/) to a
    `cortex bundle` folder; the inputs as the harness asks for them."""
    shutil.copytree(HARNESS_DIR, site / "bench", dirs_exist_ok=True)
    if not (site / "ortweb").exists():
        (site / "ortweb").symlink_to(ORTWEB_DIR / "node_modules" / "onnxruntime-web" / "dist")
    (site / "inputs").mkdir(exist_ok=True)
    inputs = []
    for k, described in enumerate(feeds_described):
        shutil.copyfile(described["data"], site / "inputs" / f"input-{k}.bin")
        inputs.append({**{key: described[key] for key in ("name", "dtype", "shape")}, "url": f"/inputs/input-{k}.bin"})
    return inputs


class Chromium:
    """One headless Chromium for the whole bench."""

    def __init__(self):
        if not CHROMIUM.is_file():
            raise BrowserUnavailable("chromium is not installed (apt-get install -y chromium)")
        try:
            from playwright.sync_api import sync_playwright
        except ImportError as e:
            raise BrowserUnavailable("playwright is not installed (pip install playwright)") from e
        self.playwright = sync_playwright().start()
        self.browser = self.playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        self.version = self.browser.version

    def page(self, origin: str, context=None):
        page = (context or self.browser).new_page()
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        page.goto(f"{origin}/bench/bench.html")
        page.wait_for_function("window.benchReady === true")
        return page

    def close(self) -> None:
        self.browser.close()
        self.playwright.stop()


def ask(page, target: str, **request) -> dict:
    reply = page.evaluate("([target, request]) => window.ask(target, request)", [target, request])
    if "error" in reply:
        raise RuntimeError(reply["error"])
    return reply


def _spread(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "runs": len(ms)}


def _max_abs(outputs: dict, reference: dict) -> float | None:
    worst = 0.0
    for name, want in reference.items():
        got = np.asarray(outputs.get(name, []), dtype=np.float64)
        if got.size != np.size(want):
            return None
        worst = max(worst, float(np.max(np.abs(got - np.asarray(want, dtype=np.float64).ravel()), initial=0.0)))
    return worst


def bench_model(browser: Chromium, site: Path, threads_site: Path | None, inputs: list[dict], reference: dict,
                rounds: int, load_repeats: int, min_pairs: int, parallel_site: Path | None = None) -> dict:
    """Run times, thread ratios, loads and memory of one model (see the module's docstring);
    `parallel_site`: the `--parallel 2` build that Cortex `numThreads: 2` runs (the default build without one)."""
    result: dict = {"errors": {}}
    with served(site, False) as plain_origin, served(site, True) as isolated_origin, \
            served(threads_site or site, True) as threads_origin, served(parallel_site or site, False) as parallel_origin:
        plain = browser.page(plain_origin)
        isolated = browser.page(threads_origin)
        parallel = browser.page(parallel_origin) if parallel_site is not None else plain
        # name -> (page, target, create request)
        contestants = {
            "cortex-1t": (plain, "main", dict(kind="cortex", model="/dag.json", options={})),
            "ortweb-1t": (plain, "main", dict(kind="ortweb", model="/model.onnx", options={"numThreads": 1})),
            "cortex-numThreads2": (parallel, "main", dict(kind="cortex", model="/dag.json", options={"numThreads": THREADS})),
            "ortweb-2t": (isolated, "ortweb-2t", dict(kind="ortweb", model="/model.onnx", options={"numThreads": THREADS})),
        }
        if threads_site is not None:
            contestants["cortex-threads2"] = (isolated, "cortex-threads2",
                                              dict(kind="cortex", model="/dag.json", options={"threads": THREADS}))
        created, agreement = {}, {}
        for name, (page, target, request) in contestants.items():
            try:
                created[name] = ask(page, target, cmd="create", id=name, inputs=inputs, **request)
                agreement[name] = _max_abs(ask(page, target, cmd="outputs", id=name)["outputs"], reference)
            except RuntimeError as e:
                result["errors"][name] = str(e)
        threads_of = {name: c["threads"] for name, c in created.items()}
        # numThreads is honoured only by a runtime that has CU workers; the trace says which mode ran.
        mode = (threads_of.get("cortex-numThreads2") or {}).get("mode")
        if "cortex-numThreads2" in created and mode != "cu-workers":
            result["errors"]["cortex-numThreads2"] = f"numThreads {THREADS} ran as {mode or 'one thread'} (no CU workers in this runtime)"
            del created["cortex-numThreads2"]
        timed = [n for n in contestants if n in created]
        probe = statistics.median(ask(*contestants["ortweb-1t"][:2], cmd="time", id="ortweb-1t", repeat=3)["ms"]) \
            if "ortweb-1t" in created else 50.0
        repeat = max(1, min(20, int(300 / max(probe, 1e-3))))
        for name in timed:      # warm-up outside the rounds
            ask(*contestants[name][:2], cmd="time", id=name, repeat=2)
        ms = {name: [] for name in timed}
        for _ in range(max(rounds * repeat, min_pairs)):
            for name in timed:
                ms[name] += ask(*contestants[name][:2], cmd="time", id=name, repeat=1)["ms"]
        for name in timed:
            ask(*contestants[name][:2], cmd="release", id=name)
        plain.close()
        isolated.close()
        if parallel is not plain:
            parallel.close()

        def paired(a: str, b: str) -> dict | None:
            if a not in ms or b not in ms:
                return None
            ratios = [x / y for x, y in zip(ms[a], ms[b])]
            return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}

        result.update(run={n: _spread(v) for n, v in ms.items()}, max_abs_vs_onnxruntime=agreement, threads=threads_of,
                      run_ratio=paired("cortex-1t", "ortweb-1t"),
                      numthreads_ratio=paired("cortex-numThreads2", "ortweb-2t"),
                      threads_ratio=paired("cortex-threads2", "ortweb-2t"),
                      cortex_numthreads_speedup=paired("cortex-1t", "cortex-numThreads2"),
                      cortex_threads_speedup=paired("cortex-1t", "cortex-threads2"),
                      ortweb_speedup=paired("ortweb-1t", "ortweb-2t"))
        result["load"] = loads(browser, plain_origin, inputs, load_repeats)
        result["memory"] = {}
        for name, kind, model, options in (("cortex", "cortex", "/dag.json", {}),
                                           ("cortex-proxy", "cortex", "/dag.json", {"proxy": True}),
                                           ("ortweb", "ortweb", "/model.onnx", {})):
            try:
                result["memory"][name] = memory_phases(site, kind, model, inputs, options)
            except RuntimeError as e:
                result["errors"][f"memory {name}"] = str(e)
    return result


def memory_phases(site: Path, kind: str, model: str, inputs: list[dict], options: dict | None = None) -> dict:
    """The page renderer's RSS before create, after the first run and after release (harness.js's
    memory phases in bench/browser/memory.html), in a Chromium of its own with no DevTools client
    (bench/chromium_memory.py: playwright's would keep every fetched file resident). `options`:
    Cortex's create options."""
    request = urllib.parse.quote(json.dumps({"kind": kind, "model": model, "inputs": inputs, "options": options or {}}))
    with tempfile.TemporaryDirectory(prefix="cortex-bench-memory-") as profile:
        phases = chromium_memory.phases_rss(site, f"bench/memory.html#{request}", Path(profile), MEMORY_TIMEOUT_S)
    if "error" in phases:
        raise RuntimeError(phases["error"])
    if "done" not in phases:
        raise RuntimeError(f"the memory page reached only {sorted(phases)} in {MEMORY_TIMEOUT_S} s")
    found = {}
    for prefix, field in (("rss", "VmRSS"), ("anon", "RssAnon"), ("file", "RssFile")):
        at = chromium_memory.page_rss(phases, "run", field)
        found.update({f"{prefix}_before": at.get("before"), f"{prefix}_after_run": at.get("run"),
                      f"{prefix}_after_release": at.get("release"), f"{prefix}_after_run2": at.get("run2"),
                      f"{prefix}_after_release2": at.get("release2")})
    return found


def loads(browser: Chromium, origin: str, inputs: list[dict], repeats: int) -> dict:
    """Cold (a fresh browser context) and warm (a second page of it) import + create + first result,
    the contestants alternating. Cortex's runtime is imported as the bundle's page does: its one-file
    form when the site has one (cortex/commands/bundle.py), else index.js and its imports."""
    runtime = next((path for path in (ONE_FILE_RUNTIME, "/cortex-runtime/index.js") if _served(origin + path)), None)
    found = {f"{kind}-{visit}": [] for kind in ("cortex", "ortweb") for visit in ("cold", "warm")}
    for _ in range(repeats):
        for kind, model in (("cortex", "/dag.json"), ("ortweb", "/model.onnx")):
            context = browser.browser.new_context()
            try:
                for visit in ("cold", "warm"):
                    page = browser.page(origin, context)
                    found[f"{kind}-{visit}"].append(ask(page, "main", cmd="first", kind=kind, model=model,
                                                        inputs=inputs, runtime=runtime)["ms"])
                    page.close()
            finally:
                context.close()
    spread = {k: _spread(v) for k, v in found.items()}
    return {**spread, "cortex_runtime": runtime,
            "cold_ratio": spread["cortex-cold"]["median_ms"] / spread["ortweb-cold"]["median_ms"],
            "warm_ratio": spread["cortex-warm"]["median_ms"] / spread["ortweb-warm"]["median_ms"]}


ONE_FILE_RUNTIME = "/cortex-runtime/one-file/index.js"


def _served(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as response:
            return response.status == 200
    except OSError:
        return False
