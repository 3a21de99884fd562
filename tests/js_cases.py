"""What the JavaScript runtime's tests read: models compiled by the Python side into `.cache/js-tests/`,
each with its feeds and onnxruntime's outputs as raw little-endian files, described by a
`case.json` that js/test/ reads (`CORTEX_JS_CASES` names a JSON list of them):

    {"name", "dag", "rtol", "atol",
     "requests": [{"inputs": {NAME: TENSOR}, "outputs": {NAME: TENSOR}, "fetches": [NAME] | null,
                   "inactive": [CU id], "not_needed": [CU id]}]}
    TENSOR = {"dtype", "shape", "file"}      (file: relative to case.json)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
from wasm_cases import compile_pipeline

from cortex.runtime.trace import validate_trace
from samples.cache import CACHE_DIR, ensure_folder

REPO_ROOT = Path(__file__).resolve().parent.parent
JS_DIR = REPO_ROOT / "js"
NODE = shutil.which("node")
NODE_TIMEOUT_S = 900
CASES_DIR = CACHE_DIR / "js-tests"
# Where `make bench` installs onnxruntime-web; the fallback CUs' case runs when it is there.
ORTWEB_DIR = REPO_ROOT / "bench" / "ortweb"


def _tensor(folder: Path, stem: str, array) -> dict:
    array = np.asarray(array)          # not ascontiguousarray: it makes a scalar one-dimensional
    name = f"{stem}.bin"
    (folder / name).write_bytes(array.astype(array.dtype.newbyteorder("<")).tobytes(order="C"))
    return {"dtype": array.dtype.name, "shape": list(array.shape), "file": name}


def write_requests(folder: Path, requests: list[dict]) -> list[dict]:
    """Each request's arrays as files in `folder`; the JSON side of `requests`."""
    described = []
    for i, request in enumerate(requests):
        described.append({
            "inputs": {n: _tensor(folder, f"r{i}-in-{k}", a) for k, (n, a) in enumerate(request["inputs"].items())},
            "outputs": {n: _tensor(folder, f"r{i}-out-{k}", a) for k, (n, a) in enumerate(request["outputs"].items())},
            "fetches": request.get("fetches"), "inactive": request.get("inactive", []),
            "not_needed": request.get("not_needed", [])})
    return described


def write_case(folder: Path, name: str, dag: Path, requests: list[dict], rtol: float, atol: float,
               fallback: bool = False) -> Path:
    case = {"name": name, "dag": os.path.relpath(dag, folder), "rtol": rtol, "atol": atol, "fallback": fallback,
            "requests": write_requests(folder, requests)}
    (folder / "case.json").write_text(json.dumps(case, indent=1))
    return folder / "case.json"


def compiled_case(case, features: str = "simd,bulk-memory", opt_level: str = "2", rtol: float = 1e-4,
                  atol: float = 1e-5, **partition) -> Path:
    """A testdata ModelCase compiled once into .cache/js-tests (keyed by the model's bytes and the
    options), with its feed and reference outputs; returns its case.json."""
    digest = hashlib.sha256(Path(case.path).read_bytes()).hexdigest()[:12]
    options = hashlib.sha256(json.dumps([features, opt_level, partition, rtol, atol]).encode()).hexdigest()[:8]

    def build(tmp: Path) -> None:
        dag = compile_pipeline(case.path, tmp, features, opt_level, case.input_shapes or None, case.dims or None,
                               **partition)
        write_case(tmp, case.name, dag, [{"inputs": case.inputs, "outputs": case.outputs}], rtol, atol)

    CASES_DIR.mkdir(parents=True, exist_ok=True)
    return ensure_folder(CASES_DIR / f"{case.name}-{digest}-{options}", build) / "case.json"


def ortweb_installed() -> bool:
    return (ORTWEB_DIR / "node_modules" / "onnxruntime-web" / "package.json").is_file()


def run_node_tests(cases: list[Path], workdir: Path, *files: str) -> str:
    """`node --test` over js/test/ (or `files` in it) with `cases`; asserts every test passed and
    at least one ran; returns the report."""
    listing = workdir / "cases.json"
    traces = workdir / "traces"
    traces.mkdir()
    listing.write_text(json.dumps([str(c) for c in cases]))
    targets = [str(JS_DIR / "test" / f) for f in files] or [str(JS_DIR / "test")]
    env = {**os.environ, "CORTEX_JS_CASES": str(listing), "CORTEX_JS_TRACES": str(traces)}
    if ortweb_installed():
        env["CORTEX_JS_ORTWEB"] = str(ORTWEB_DIR)
    done = subprocess.run([NODE, "--experimental-wasm-relaxed-simd", "--test", *targets], check=False,
                          capture_output=True, text=True, timeout=NODE_TIMEOUT_S, cwd=REPO_ROOT, env=env)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-6000:]
    counts = {line.split()[1]: int(line.split()[2]) for line in report.splitlines()
              if line.startswith("# ") and len(line.split()) == 3 and line.split()[2].isdigit()}
    assert counts.get("fail") == 0 and counts.get("pass", 0) > 0, report[-3000:]
    written = sorted(traces.glob("*.json"))
    assert written, "the Node tests wrote no trace"
    for path in written:                  # the JS trace follows the Python runtime's schema
        validate_trace(json.loads(path.read_text()))
    return report
