"""The bundle's example page in headless Chromium, served from 127.0.0.1 once cross-origin isolated
(COOP/COEP headers) and once not, with `?threads=2` (the runtime's modules preloaded, all at once), the
runtime as js/src's modules or as its one-file build (js/build.mjs; its Workers' entry points too):
both give onnxruntime's outputs, each says in
its trace how its threads ran (CU workers on the page's main thread: it may not block, so a
split kernel's threads are not an option there), and create's progress events arrive in order and
end at their totals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli
from test_js_browser import CHROMIUM, PAGE_TIMEOUT_MS
from test_js_cu_workers import SPLIT, branchy_model
from test_js_threads_browser import opened_page
from testdata import run_onnxruntime

from cortex.commands.bundle import JS_DIR
from cortex.commands.run import example_feeds
from cortex.dag import read_dag

pytestmark = pytest.mark.skipif(not CHROMIUM.is_file(), reason="chromium is not installed (apt-get install -y chromium)")


def page_found(site: Path, isolated: bool, query: str) -> dict:
    """`window.cortexBundle` of the site's index.html?query, served isolated or not."""
    errors: list[str] = []
    with opened_page(site, isolated, f"index.html?{query}", errors) as page:
        page.wait_for_function("window.cortexBundle && window.cortexBundle.status !== 'loading'",
                               timeout=PAGE_TIMEOUT_MS)
        found = page.evaluate("window.cortexBundle")
    assert not errors, errors
    return found


@pytest.fixture(scope="module")
def branchy_build(tmp_path_factory):
    """A build of independent MatMul chains (CUs that can run at once) and onnxruntime's outputs on
    the page's example inputs."""
    folder = tmp_path_factory.mktemp("page-modes")
    model_path = folder / "branchy.onnx"
    onnx.save(branchy_model(np.random.default_rng(11)), model_path)
    code, _, err = run_cli(["build", model_path, "--output", folder / "out", *SPLIT])
    assert code == 0, err
    expected = run_onnxruntime(model_path, example_feeds(read_dag(folder / "out" / "dag.json")["inputs"]))
    return folder, expected


@pytest.fixture(scope="module", params=["modules", "one-file"])
def branchy_site(branchy_build, request):
    """The build's bundle with the runtime as js/src's modules, or as the one-file build alone (js/src's
    copies taken out of the site, so a page or Worker that still fetched one would fail)."""
    folder, expected = branchy_build
    site = folder / f"site-{request.param}"
    build = folder / f"runtime-{request.param}"
    if request.param == "one-file":
        if not (JS_DIR / "node_modules" / "esbuild").is_dir():
            pytest.skip("esbuild is not installed ('make js-runtime' installs it)")
        done = subprocess.run(["node", str(JS_DIR / "build.mjs"), str(build)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    code, out, err = run_cli(["bundle", folder / "out" / "dag.json", "--output", site, "--json",
                              "--runtime", request.param, "--runtime-build", build])
    assert code == 0, err
    page_runtime = "cortex-runtime/one-file" if request.param == "one-file" else "cortex-runtime"
    assert json.loads(out)["page_runtime"] == f"{page_runtime}/index.js"
    assert (site / "cortex-runtime" / "one-file").is_dir() == (request.param == "one-file")
    if request.param == "one-file":
        for module in (site / "cortex-runtime").glob("*.js"):
            module.unlink()
    return site, page_runtime, expected


@pytest.mark.parametrize("isolated", [False, True], ids=["not-isolated", "isolated"])
def test_the_page_runs_on_two_threads_isolated_or_not_with_onnxruntimes_outputs(branchy_site, isolated):
    site, page_runtime, expected = branchy_site
    page = (site / "index.html").read_text()
    runtime = sorted(f.name for f in (site / page_runtime).glob("*.js") if not f.name.endswith("_worker.js"))
    assert runtime and page.count('<link rel="modulepreload"') == len(runtime)
    assert all(f'<link rel="modulepreload" href="{page_runtime}/{name}">' in page for name in runtime)
    assert f'from "./{page_runtime}/index.js"' in (site / "main.js").read_text()
    found = page_found(site, isolated, "threads=2&policy=strict")
    assert found["status"] == "done", found.get("error")
    assert found["isolated"] is isolated
    for name, want in expected.items():
        got = np.array(found["outputs"][name]["data"], dtype=np.float32).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    threads = found["trace"]["threads"]
    assert threads["mode"] == "cu-workers" and threads["threads"] == 2, threads
    assert {entry["thread"] for entry in found["trace"]["cus"]} == {0, 1}, found["trace"]["cus"]
    events = found["progress"]
    assert len(events) >= 2
    for before, after in zip(events, events[1:], strict=False):
        assert after["bytes"] >= before["bytes"] and after["cus"] >= before["cus"], events
        assert (after["totalBytes"], after["totalCus"]) == (before["totalBytes"], before["totalCus"]), events
    last = events[-1]
    assert last["bytes"] == last["totalBytes"] > 0 and last["cus"] == last["totalCus"] > 0, last
