"""A page's memory in headless Chromium with no DevTools client attached: the renderers' resident
bytes (from /proc) at each phase a page reports.

Playwright, or any DevTools client, turns on the Network domain, whose agent keeps the body of every
response the page fetched, in the renderer, for Network.getResponseBody: a runtime's files stay
resident after it gives its memory back, and every later load adds its own (tests/test_js_memory_browser.py
measured it). So memory is read from a Chromium started on its own: the page fetches
`/phase?NAME` when it reaches a phase (after collecting garbage, --js-flags=--expose-gc), and the
server reads the renderers' RSS (and its anonymous and file-backed parts) before it answers; `/phase?error=MESSAGE` ends the run with an error.
"""

from __future__ import annotations

import functools
import http.server
import os
import signal
import subprocess
import threading
import urllib.parse
from pathlib import Path
from typing import ClassVar

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
        "--disable-background-networking", "--disable-component-update", "--js-flags=--expose-gc"]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """A static file server for pages: wasm and JavaScript with their types, no log lines."""
    extensions_map: ClassVar[dict[str, str]] = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                                                ".wasm": "application/wasm", ".js": "text/javascript",
                                                ".mjs": "text/javascript"}

    def log_message(self, format, *args):
        pass


class IsolatedHandler(QuietHandler):
    """The same, with the COOP/COEP headers that make its pages crossOriginIsolated."""

    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()


def descendants(pid: int) -> set[int]:
    """The processes under `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, frontier = set(), [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, []) if c not in found]
        found.update(frontier)
    return found


# The fields of /proc/PID/status read at each phase: the resident set, and its private anonymous
# part (heaps, wasm memories, compiled code) apart from its file-backed part. The file-backed part
# is mostly Chromium's own executable, paged in the first time a page runs code that needs it (the
# optimising compilers of wasm and JavaScript: ~10 MB on MiniLM's first session, once a renderer,
# for Cortex and onnxruntime-web alike); clean pages of a file the kernel takes back under pressure.
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile")


def renderers_memory(browser_pid: int) -> dict[int, dict[str, int]]:
    """pid -> {field: bytes} of STATUS_FIELDS for each Chromium renderer process under the browser."""
    found = {}
    for pid in descendants(browser_pid):
        try:
            if b"--type=renderer" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
            found[pid] = {name: int(fields[name].split()[0]) * 1024 for name in STATUS_FIELDS if name in fields}
        except OSError:
            continue
    return found


def phases_rss(site: Path, page: str, profile: Path, timeout_s: float, isolated: bool = False) -> dict:
    """Serves `site` on 127.0.0.1 (with COOP/COEP when `isolated`), opens `page` of it in a Chromium
    of its own (profile folder `profile`) and returns each phase the page reported -> the renderers'
    RSS then ({pid: bytes}), and "error" -> the page's message if it reported one. Ends at the phase
    "done", an error or `timeout_s`."""
    phases: dict = {}
    done = threading.Event()
    browser: list[subprocess.Popen] = []

    class Handler(IsolatedHandler if isolated else QuietHandler):
        def do_GET(self):
            if not self.path.startswith("/phase?"):
                return super().do_GET()
            phase = self.path.split("?", 1)[1]
            if phase.startswith("error="):
                phases["error"] = urllib.parse.unquote(phase[len("error="):])
            else:
                phases[phase] = renderers_memory(browser[0].pid)
            if phase == "done" or phase.startswith("error="):
                done.set()
            self.send_response(204)
            self.end_headers()
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        browser.append(subprocess.Popen(
            [str(CHROMIUM), *ARGS, f"--user-data-dir={profile}", f"http://127.0.0.1:{server.server_address[1]}/{page}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        done.wait(timeout_s)
    finally:
        if browser:
            os.killpg(browser[0].pid, signal.SIGTERM)
            browser[0].wait(timeout=30)
        server.shutdown()
        server.server_close()
    return phases


def page_rss(phases: dict, grown_at: str, field: str = "VmRSS") -> dict[str, int]:
    """The page renderer's `field` (one of STATUS_FIELDS) at each phase: the renderer whose resident
    set grew most from "before" to `grown_at` (the one that holds the model)."""
    grown = phases[grown_at]
    page = max(grown, key=lambda pid: grown[pid]["VmRSS"] - phases["before"].get(pid, {}).get("VmRSS", 0))
    return {phase: found[page][field] for phase, found in phases.items()
            if isinstance(found, dict) and page in found and field in found[page]}
