"""A CU's `run` export called through wasmtime's C API directly (backends/wasm/direct_call.py)
computes the same bits as wasmtime-py's public `Func.__call__`, which stays the fallback."""

from __future__ import annotations

import numpy as np
import pytest

import cortex
from backends.wasm import instance as wasm_instance
from runtime_cases import WIDTH, build, two_output_model
from testdata import run_onnxruntime


@pytest.fixture(scope="module")
def two_outputs(tmp_path_factory):
    return build(two_output_model(), tmp_path_factory.mktemp("direct_call"))


def test_the_direct_call_and_the_public_api_agree_bit_for_bit(two_outputs, monkeypatch):
    x = {"x": np.random.default_rng(3).standard_normal((4, WIDTH)).astype(np.float32)}
    direct = cortex.load(two_outputs, policy="strict", threads=1)
    assert all(i._direct is not None for i in direct.device.instances.values())
    monkeypatch.setattr(wasm_instance.DirectCall, "supported", staticmethod(lambda store, func: False))
    public = cortex.load(two_outputs, policy="strict", threads=1)
    assert all(i._direct is None for i in public.device.instances.values())
    got, expected = direct.run(x), public.run(x)
    reference = run_onnxruntime(two_outputs.parent / "two_outputs.onnx", x)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-6)
    assert direct.last_trace["cus"][0]["resident_bytes"] == public.last_trace["cus"][0]["resident_bytes"] > 0
