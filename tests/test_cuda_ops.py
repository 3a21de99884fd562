"""Every op case of the WebAssembly op suites (tests/test_wasm_ops.py, test_wasm_ops_less_common.py), run instead through the CUDA
renderer and cuda-sim, with permuted block and thread order: each op's generated kernels match
onnxruntime, and the same source compiles with NVRTC for sm_80 without spills. The cases are written
once; only the backend they run on differs."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import test_wasm_ops as op_cases
import test_wasm_ops_less_common as less_common_cases
from backends.cuda.toolchain import compile_cuda, nvrtc_version
from cuda_cases import run_cuda_sim
from wasm_cases import run_onnxruntime


def assert_cuda_sim_matches_onnxruntime(model, feeds, configs=None, rtol=1e-4, atol=1e-5):
    expected = run_onnxruntime(model, feeds)
    got, source = run_cuda_sim(model, feeds, seed=7, with_source=True)
    if nvrtc_version():
        assert compile_cuda(source, "case.cu", ("sm_80",), "nvrtc").spilling_kernels() == []
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=f"{name} on cuda-sim")


@pytest.fixture(autouse=True)
def on_cuda_sim(monkeypatch):
    for module in (op_cases, less_common_cases):
        monkeypatch.setattr(module, "assert_matches_onnxruntime", assert_cuda_sim_matches_onnxruntime)


# The cases that go through the shared assertion (others test wasm-only details).
for _module in (op_cases, less_common_cases):
    for _name, _case in inspect.getmembers(_module, inspect.isfunction):
        if _name.startswith("test_") and "assert_matches_onnxruntime" in inspect.getsource(_case):
            globals()[_name.replace("test_", "test_cuda_", 1)] = pytest.mark.slow(_case)
