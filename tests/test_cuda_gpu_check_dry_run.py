"""`make gpu-check` prepared without a GPU: its dry run (cuda-sim and hybrid-sim, tiny sizes) goes
through every step and writes one JSON and one Markdown file, and the CUDA path it takes imports
no wasmtime (the GPU machine has none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Loaded by every Python process of the run (the conformance workers too) through PYTHONPATH.
WITHOUT_WASMTIME = """
import sys
class NoWasmtime:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "wasmtime":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoWasmtime())
"""


@pytest.mark.slow
def test_the_dry_run_writes_its_json_and_markdown_without_wasmtime(tmp_path):
    out = tmp_path / "gpu-check"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(WITHOUT_WASMTIME)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--models", "mlp",
                          "--kernel-sizes", "32", "--repeats", "1", "--conformance-cases", "test_relu$", "--jobs", "1",
                          "--out", str(out / "build"), "--output", str(out / "gc.json"),
                          "--markdown", str(out / "gc.md")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    document = json.loads((out / "gc.json").read_text())
    assert {k["precision"] for k in document["kernels"]} == {"exact", "tf32", "fp16", "bf16"}
    assert all(k["tensor_core_kernels"] for k in document["kernels"] if k["precision"] != "exact")
    assert all(k["relative_error"] < 1e-2 for k in document["kernels"])
    # Each tensor-core precision on its block tiling and on the single-tile kernel beside it.
    kernels = {(k["precision"], k["kernel"]) for k in document["kernels"]}
    assert {("tf32", "32x32 block"), ("tf32", "single 16x16 tile per warp, 1 stage")} <= kernels
    assert len(kernels) == 7
    (row,) = document["models"]
    assert row["matches_onnxruntime"] and row["hybrid_max_error_vs_cuda"] < 1e-5 and "tf32_max_error" in row
    assert set(row["hybrid_placement"]) <= {"cuda-sim", "onnxruntime"}    # no wasm without wasmtime
    assert document["hybrid"]["cus"] >= 1 and "crossover_flops" in document["hybrid"]
    # The same path as `cortex calibrate --hybrid`: the model's dag.json holds its own crossover.
    recorded = json.loads((out / "build" / "mlp" / "dag.json").read_text())["hybrid"]
    assert recorded["device"] == "cuda-sim" and len(recorded["cus"]) == document["hybrid"]["cus"]
    assert {t["cpu_device"] for t in recorded["cus"].values()} == {"onnxruntime"}
    assert document["hybrid"]["models"]["mlp"]["crossover_flops"] == recorded["crossover_flops"]
    assert document["conformance"]["summary"]["passed"] == 1
    markdown = (out / "gc.md").read_text()
    assert "| mlp | yes |" in markdown and "| 32 | tf32 | 32x32 block |" in markdown and "x single tile" in markdown


def test_an_unknown_model_is_one_line_and_nothing_is_written(tmp_path, capsys):
    from bench import gpu_check

    code = gpu_check.main(["--dry-run", "--models", "nonesuch", "--output", str(tmp_path / "gc.json"),
                           "--markdown", str(tmp_path / "gc.md")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'nonesuch'" in err
    assert not list(tmp_path.iterdir())
