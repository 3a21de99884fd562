"""`make gpu-check` (bench/gpu_check.py): without a GPU it stops with one line and exit code 2 and
writes nothing; with results, it rewrites only its own section of docs/benchmarks.md."""

from __future__ import annotations

import pytest

from backends.cuda import device as cuda_device
from bench import gpu_check


def _gpu_available() -> bool:
    try:
        cuda_device.open_driver()
        return True
    except cuda_device.CudaDeviceError:
        return False


@pytest.mark.skipif(_gpu_available(), reason="this machine has a CUDA driver and a GPU")
def test_without_a_gpu_it_stops_with_one_line_and_leaves_the_docs_untouched(tmp_path, capsys):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nhand-written text\n")
    before = docs.read_bytes()
    code = gpu_check.main(["--docs", str(docs), "--output", str(tmp_path / "gpu-check.json"),
                           "--out", str(tmp_path / "build")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("gpu-check: --device cuda:")
    assert docs.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmarks.md"]


DOCUMENT = {
    "gpu": "NVIDIA H200", "arch": "sm_90", "device": "cuda", "compiler": "nvcc 13.0", "commit": "abc1234",
    "date": "2026-11-29 12:00 UTC", "repeats": 20, "elapsed_s": 300,
    "kernels": [{"size": 4096, "precision": "tf32", "kernel": "128x64 block", "ms": 2.0, "tflops": 68.72,
                 "relative_error": 4e-4, "tensor_core_kernels": ["k"]},
                {"size": 4096, "precision": "tf32", "kernel": "single 16x16 tile per warp, 1 stage", "ms": 8.0,
                 "tflops": 17.18, "relative_error": 4e-4, "tensor_core_kernels": ["k"]}],
    "models": [
        {"model": "cnn", "matches_onnxruntime": True, "cortex_ms": 0.5, "tflops": 0.1, "torch": "torch eager CUDA",
         "torch_ms": 0.25, "hybrid_ms": 0.4, "hybrid_placement": {"cuda": 2, "onnxruntime": 1},
         "hybrid_bytes_crossed": 4096, "tf32_ms": 0.45, "tf32_max_error": 3e-4},
        {"model": "mlp", "matches_onnxruntime": True, "cortex_ms": 2.0, "torch": "torch eager CUDA", "torch_ms": 1.0},
        {"model": "minilm", "matches_onnxruntime": False, "error": "output 'y': 3 of 10 values off"},
    ],
    "skipped": ["light_resnet50"],
    "conformance": {"exit_code": 0, "table": "docs/conformance-cuda.md",
                    "summary": {"counted": 1500, "passed": 1200, "failed": 3, "unsupported": 290, "crashed": 7,
                                "pass_rate": 0.8}},
}


def test_the_section_reports_each_model_the_geomean_and_the_conformance_figure():
    section = gpu_check.render_section(DOCUMENT)
    assert section.startswith(gpu_check.BEGIN) and section.rstrip().endswith(gpu_check.END)
    assert "| cnn | yes | 0.500 | 0.100 | 0.250 | 2.00 | 0.400 | 0.80 | 2 cuda, 1 onnxruntime | 4096 | 0.450 | 3.0e-04 |" in section
    assert "| minilm | **no**: output 'y': 3 of 10 values off | n/a |" in section
    assert "| 4096 | tf32 | 128x64 block | 2.000 | 68.72 | 4.00 | 1 | 4.0e-04 |" in section   # x the single tile
    assert "| 4096 | tf32 | single 16x16 tile per warp, 1 stage | 8.000 | 17.18 | - | 1 | 4.0e-04 |" in section
    assert "Geomean Cortex CUDA / torch eager CUDA (lower is faster): 2.00 over 2 models." in section
    assert "1200 of 1500 node-test cases that onnxruntime passes pass (80.0%)" in section
    assert "Not run, for the time budget: light_resnet50." in section


def test_rewriting_the_section_keeps_the_rest_of_the_page(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- BEGIN other -->\nwasm figures\n<!-- END other -->\n")
    gpu_check.write_section(docs, gpu_check.render_section(DOCUMENT))
    first = docs.read_text()
    gpu_check.write_section(docs, gpu_check.render_section({**DOCUMENT, "commit": "def5678"}))
    text = docs.read_text()
    assert "wasm figures" in text and text.count(gpu_check.BEGIN) == 1
    assert "def5678" in text and "abc1234" not in text and len(text) == len(first)


@pytest.mark.skipif(_gpu_available(), reason="this machine has a CUDA driver and a GPU")
def test_the_conformance_suite_knows_the_cuda_device_and_says_why_it_cannot_run_here():
    from bench.conformance.devices import device_names, unavailable_reason
    assert "cuda" in device_names()
    reason = unavailable_reason("cuda")
    assert reason.startswith("--device cuda:") and "\n" not in reason
