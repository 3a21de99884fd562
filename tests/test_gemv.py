"""The WASM GEMV kernel (one or two rows over packed B) against numpy: edge panels, short K,
transposed A, every epilogue, with and without relaxed SIMD; and that products of one or two rows
are the ones that run on it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backends.wasm.gemm import SIMD, SIMD_FMA, pack_b, packed_b_size
from backends.wasm.kernels.gemv import gemv_fits, render_gemv
from backends.wasm.kernels.operands import GemmOffsets
from backends.wasm.kernels.standalone import instantiate, read, write
from ir.loops.contraction import EpilogueSpec, GemmSpec

_erf = np.vectorize(math.erf)


def run_gemv(a, b, *, bias=None, residual=None, epilogue=None, trans_a=False, features=SIMD_FMA, residual_is_c=False):
    m, k = a.T.shape if trans_a else a.shape
    n = b.shape[1]
    offsets, end = {}, 64
    for key, size in (("a", a.nbytes), ("b", packed_b_size(k, n)), ("c", m * n * 4), ("bias", n * 4),
                      ("res", m * n * 4)):
        offsets[key], end = end, end + size + 16
    if residual_is_c:
        offsets["res"] = offsets["c"]
    spec = GemmSpec(m, n, k, trans_a=trans_a, epilogue=EpilogueSpec(bias is not None, residual is not None, epilogue))
    at = GemmOffsets(offsets["a"], offsets["b"], offsets["c"], bias=offsets["bias"] if bias is not None else None,
                     residual=offsets["res"] if residual is not None else None)
    store, inst = instantiate(render_gemv(spec, at, features=features), end, features)
    write(store, inst, offsets["a"], a)
    write(store, inst, offsets["b"], pack_b(b))
    guard = np.full(4, 7.0, np.float32)          # what follows C must stay untouched
    write(store, inst, offsets["c"] + m * n * 4, guard)
    if bias is not None:
        write(store, inst, offsets["bias"], bias)
    if residual is not None:
        write(store, inst, offsets["res"], residual)
    inst.exports(store)["gemv"](store)
    assert (read(store, inst, offsets["c"] + m * n * 4, (4,)) == guard).all()
    return read(store, inst, offsets["c"], (m, n))


@pytest.mark.parametrize("features", [SIMD, SIMD_FMA], ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 1), (1, 384, 128), (2, 1536, 37), (1, 20, 5), (2, 7, 3), (2, 49, 130)])
def test_gemv_matches_numpy(m, n, k, features):
    rng = np.random.default_rng(m * 1000 + n + k)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    np.testing.assert_allclose(run_gemv(a, b, features=features), a.astype(np.float64) @ b, rtol=1e-4,
                               atol=1e-4 * math.sqrt(k))


@pytest.mark.parametrize("epilogue", [None, "relu", "gelu"])
def test_gemv_epilogue_bias_residual_and_transposed_a(epilogue):
    rng = np.random.default_rng(5)
    m, n, k = 2, 40, 19
    a_t = rng.standard_normal((k, m)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias, residual = rng.standard_normal(n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    want = a_t.T.astype(np.float64) @ b + bias + residual
    if epilogue == "relu":
        want = np.maximum(want, 0)
    if epilogue == "gelu":
        want = 0.5 * want * (1 + _erf(want / math.sqrt(2)))
    got = run_gemv(a_t, b, bias=bias, residual=residual, epilogue=epilogue, trans_a=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gemv_residual_may_be_c():
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((1, 33)).astype(np.float32), rng.standard_normal((33, 50)).astype(np.float32)
    residual = rng.standard_normal((1, 50)).astype(np.float32)
    got = run_gemv(a, b, residual=residual, residual_is_c=True)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b + residual, rtol=1e-4, atol=1e-4)


def test_only_one_or_two_rows_with_simd_run_as_a_gemv():
    assert gemv_fits(GemmSpec(1, 64, 64), SIMD) and gemv_fits(GemmSpec(2, 64, 64), SIMD_FMA)
    assert not gemv_fits(GemmSpec(3, 64, 64), SIMD_FMA)
    assert not gemv_fits(GemmSpec(1, 64, 64, batch=2), SIMD_FMA)
    assert not gemv_fits(GemmSpec(1, 64, 64), frozenset())
