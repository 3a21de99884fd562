"""The bundle's example page in headless Chromium (Debian's chromium, driven by playwright; no browser
download), served by http.server on 127.0.0.1: its outputs on the example inputs match onnxruntime's,
and its chart has a bar per CU that ran; under `?policy=offline` a bundle written with --with-source
runs the source model on the onnxruntime-web it carries, as a bundle with fallback CUs runs them."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from cli_helpers import run_cli
from js_cases import compiled_case, ortweb_installed
from test_fallback_cus import mixed_model
from test_js_node import fallback_case
from test_js_variants import variants_case
from testdata import run_onnxruntime, sample_model

import cortex
from cortex.commands.run import example_feeds

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PAGE_TIMEOUT_MS = 120_000

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = pytest.mark.skipif(not CHROMIUM.is_file() or shutil.which("chromium") is None,
                                reason="chromium is not installed (apt-get install -y chromium)")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    extensions_map: ClassVar[dict[str, str]] = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".wasm": "application/wasm",
                      ".js": "text/javascript"}

    def log_message(self, format, *args):
        pass


def served(folder: Path):
    """An http.server on 127.0.0.1 (a free port) serving `folder`, on a daemon thread."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def site_result(site: Path) -> tuple[dict, int]:
    """`page_result` of the bundle's index.html, served from `site` for the page's life."""
    server = served(site)
    try:
        return page_result(f"http://127.0.0.1:{server.server_address[1]}/index.html")
    finally:
        server.shutdown()
        server.server_close()


def page_result(url: str) -> tuple[dict, int]:
    """What the page left in `window.cortexBundle`, and the bars its chart drew."""
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_function("window.cortexBundle && window.cortexBundle.status !== 'loading'",
                                   timeout=PAGE_TIMEOUT_MS)
            result = page.evaluate("window.cortexBundle")
            bars = page.locator("#chart rect").count()
        finally:
            browser.close()
    assert not errors, errors
    return result, bars


@pytest.mark.parametrize("name, features", [("mlp", "simd"), ("cnn", "simd,bulk-memory,relaxed-simd")])
def test_the_example_page_matches_onnxruntime_in_chromium(tmp_path, name, features):
    case = sample_model(name)
    listing = compiled_case(case, features, opt_level="3" if "relaxed" in features else "2", min_cu_size=256,
                            max_cu_depth=3)
    dag = listing.parent / json.loads(listing.read_text())["dag"]
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert code == 0, err
    specs = json.loads(dag.read_text())["inputs"]
    expected = run_onnxruntime(case.path, example_feeds(specs))
    result, bars = site_result(site)
    assert result["status"] == "done", result.get("error")
    assert sorted(result["outputs"]) == sorted(expected)
    for out_name, want in expected.items():
        got = result["outputs"][out_name]
        assert got["dims"] == list(want.shape)
        np.testing.assert_allclose(np.array(got["data"], dtype=np.float64).reshape(want.shape), want,
                                   rtol=1e-4, atol=1e-5, err_msg=out_name)
    assert result["trace"]["schema"] == "cortex.trace/1"
    assert bars == len(result["trace"]["activated_cus"]) > 0
    assert result["loadMs"] > 0


def test_the_page_runs_the_variants_python_picks_in_chromium(tmp_path):
    """A bundle of the calibrated variants model (tests/test_js_variants.py): under balanced the
    page runs the variants the Python runtime runs on the same inputs, and gives its outputs."""
    listing = variants_case()
    dag = listing.parent / json.loads(listing.read_text())["dag"]
    site = tmp_path / "site"
    code, _, err = run_cli(["bundle", dag, "--output", site])
    assert code == 0, err
    feeds = example_feeds(json.loads(dag.read_text())["inputs"])
    python = cortex.load(dag, threads=1)
    expected = python.run(feeds)["y"]
    result, bars = site_result(site)
    assert result["status"] == "done", result.get("error")
    trace = result["trace"]
    assert trace["approximated_cus"] == python.last_trace["approximated_cus"] and trace["approximated_cus"]
    assert trace["fell_back_cus"] == python.last_trace["fell_back_cus"]
    np.testing.assert_allclose(np.array(result["outputs"]["y"]["data"]).reshape(expected.shape), expected,
                               rtol=1e-5, atol=1e-6)
    assert bars == len(trace["activated_cus"])


def bundled_with_onnxruntime_web(listing: Path, tmp_path: Path, *options: str) -> tuple[Path, dict, Path]:
    """The case's dag.json, its document, and a `cortex bundle` of it that carries onnxruntime-web."""
    if not ortweb_installed():
        pytest.skip("onnxruntime-web is not installed (make ortweb)")
    dag = listing.parent / json.loads(listing.read_text())["dag"]
    site = tmp_path / "site"
    code, out, err = run_cli(["bundle", dag, "--output", site, *options, "--json"])
    assert code == 0, err
    assert json.loads(out)["onnxruntime_web"] == "onnxruntime-web/"
    return dag, json.loads(dag.read_text()), site


def test_the_page_runs_offline_on_the_onnxruntime_web_the_bundle_carries_in_chromium(tmp_path):
    """`bundle --with-source` carries onnxruntime-web's browser build beside the source model, and
    `index.html?policy=offline` runs the source model on it: onnxruntime's outputs, the offline
    trace, no CU. The bundle without the source model carries neither."""
    dag, document, site = bundled_with_onnxruntime_web(variants_case(), tmp_path, "--with-source")
    assert (site / "onnxruntime-web" / "ort-wasm-simd-threaded.wasm").is_file()
    assert '"onnxruntime-web": "./onnxruntime-web/ort.wasm.bundle.min.mjs"' in (site / "index.html").read_text()
    feeds = example_feeds(document["inputs"])
    expected = run_onnxruntime(dag.parent / "model.onnx", feeds)
    server = served(site)
    try:
        result, bars = page_result(f"http://127.0.0.1:{server.server_address[1]}/index.html?policy=offline")
    finally:
        server.shutdown()
        server.server_close()
    assert result["status"] == "done", result.get("error")
    trace = result["trace"]
    assert trace["policy"] == "offline" and trace["activated_cus"] == [] and bars == 0
    assert trace["offline"]["model"] == "source/model.onnx" and trace["offline"]["runtime"] == "onnxruntime"
    for name, want in expected.items():
        got = result["outputs"][name]
        np.testing.assert_allclose(np.array(got["data"]).reshape(want.shape), want, rtol=1e-5, atol=1e-6, err_msg=name)
    plain = tmp_path / "plain"
    code, _, err = run_cli(["bundle", dag, "--output", plain])
    assert code == 0, err
    assert not (plain / "onnxruntime-web").exists() and "importmap" not in (plain / "index.html").read_text()


def test_the_page_runs_fallback_cus_on_the_onnxruntime_web_the_bundle_carries_in_chromium(tmp_path):
    """A bundle with a fallback CU (runs_on: onnxruntime) carries onnxruntime-web too: the page
    runs that CU on it and the model's outputs match onnxruntime's."""
    _, document, site = bundled_with_onnxruntime_web(fallback_case(), tmp_path)
    expected = run_onnxruntime(mixed_model(), example_feeds(document["inputs"]))
    result, bars = site_result(site)
    assert result["status"] == "done", result.get("error")
    fallback = sorted(cu["id"] for cu in document["cus"] if cu.get("runs_on") == "onnxruntime")
    assert fallback and sorted(f["cu"] for f in result["trace"]["fell_back_cus"]) == fallback
    assert bars == len(result["trace"]["activated_cus"])
    for name, want in expected.items():
        got = result["outputs"][name]
        np.testing.assert_allclose(np.array(got["data"]).reshape(want.shape), want, rtol=1e-4, atol=1e-5, err_msg=name)
