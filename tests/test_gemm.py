"""The WASM GEMM kernel against numpy: any shape, every feature set, every epilogue."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.wasm import gemm
from backends.wasm.gemm import (SCALAR, SIMD, SIMD_FMA, gemm_scratch_bytes, k_block_size, pack_a, pack_b,
                                packed_a_size, packed_b_size, packs_a, render_gemm)
from backends.wasm.kernels.pack_b import render_pack_b
from backends.wasm.kernels.microkernel import edge_pass_lanes
from backends.wasm.kernels.operands import GemmLayout, GemmOffsets
from backends.wasm.kernels.standalone import instantiate, read, write
from ir.loops.contraction import EpilogueSpec, GemmSpec

FEATURE_SETS = {"scalar": SCALAR, "simd": SIMD, "relaxed-simd": SIMD_FMA}
_erf = np.vectorize(math.erf)


_OFFSETS = {"a_offset": "a", "b_packed_offset": "b_packed", "c_offset": "c", "bias_offset": "bias",
            "residual_offset": "residual", "a_scratch_offset": "a_scratch"}


def gemm_wat(m, n, k, *, epilogue=None, trans_a=False, batch=1, features=SIMD_FMA, **placement):
    """`render_gemm` from keywords: the spec's, the offsets' (`a_offset`, `bias_offset`...) and the
    layout's (`lda`, `bias_per_row`...)."""
    at = GemmOffsets(**{_OFFSETS[key]: placement.pop(key) for key in list(placement) if key in _OFFSETS})
    spec = GemmSpec(m, n, k, batch=batch, trans_a=trans_a,
                    epilogue=EpilogueSpec(at.bias is not None, at.residual is not None, epilogue))
    return render_gemm(spec, at, features=features, layout=GemmLayout(**placement))


def reference(a, b, bias=None, residual=None, epilogue=None, bias_per_row=False):
    c = a.astype(np.float64) @ b.astype(np.float64)
    if bias is not None:
        c = c + (bias[:, None] if bias_per_row else bias)
    if residual is not None:
        c = c + residual
    if epilogue == "relu":
        c = np.maximum(c, 0)
    if epilogue == "gelu":
        c = 0.5 * c * (1 + _erf(c / math.sqrt(2)))
    return c


def run_gemm(a, b, *, bias=None, residual=None, epilogue=None, features=SIMD_FMA, trans_a=False, bias_per_row=False):
    """Lay out A, packed B, bias, residual and C one after another and run the kernel once."""
    a_rows = a.T if trans_a else a
    m, k = a_rows.shape
    n = b.shape[1]
    offsets, end = {}, 64  # start past 0 so that a zero offset bug shows
    for key, size in (("a", a.nbytes), ("b", packed_b_size(k, n)), ("c", m * n * 4),
                      ("bias", max(m, n) * 4), ("res", m * n * 4)):
        offsets[key], end = end, end + size + 16
    func = gemm_wat(m, n, k, a_offset=offsets["a"], b_packed_offset=offsets["b"], c_offset=offsets["c"],
                       bias_offset=offsets["bias"] if bias is not None else None,
                       residual_offset=offsets["res"] if residual is not None else None,
                       epilogue=epilogue, features=features, trans_a=trans_a, bias_per_row=bias_per_row)
    store, inst = instantiate(func, end, features)
    write(store, inst, offsets["a"], a)
    write(store, inst, offsets["b"], pack_b(b))
    write(store, inst, offsets["c"], np.full((m, n), np.nan, np.float32))  # every element must be written
    if bias is not None:
        write(store, inst, offsets["bias"], bias)
    if residual is not None:
        write(store, inst, offsets["res"], residual)
    inst.exports(store)["gemm"](store)
    return read(store, inst, offsets["c"], (m, n))


def assert_close(got, want, k):
    # float32 accumulation over k terms of unit-variance products
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6 * max(k, 1) ** 0.5 * 4)


@pytest.mark.parametrize("features", FEATURE_SETS.values(), ids=FEATURE_SETS.keys())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 11), n=st.integers(1, 40), k=st.integers(1, 300), data=st.data())
def test_gemm_matches_numpy_for_any_shape(features, m, n, k, data):
    rng = np.random.default_rng(m * 10007 + n * 101 + k)
    epilogue = data.draw(st.sampled_from([None, "relu", "gelu"]))
    bias_mode = data.draw(st.sampled_from([None, "column", "row"]))
    with_residual, trans_a = data.draw(st.tuples(st.booleans(), st.booleans()))
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(m if bias_mode == "row" else n).astype(np.float32) if bias_mode else None
    res = rng.standard_normal((m, n)).astype(np.float32) if with_residual else None
    got = run_gemm(a, b, bias=bias, residual=res, epilogue=epilogue, features=features, trans_a=trans_a,
                   bias_per_row=bias_mode == "row")
    assert_close(got, reference(a.T if trans_a else a, b, bias, res, epilogue, bias_mode == "row"), k)


@pytest.mark.parametrize("features", FEATURE_SETS.values(), ids=FEATURE_SETS.keys())
@pytest.mark.parametrize("m,n,k", [(1, 3072, 96), (64, 64, 64), (100, 48, 257), (2, 17, 129), (490, 21, 140)])
def test_gemm_handles_gemv_and_multi_block_shapes(features, m, n, k):
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    assert_close(run_gemm(a, b, bias=bias, epilogue="relu", features=features), reference(a, b, bias, None, "relu"), k)


@pytest.mark.parametrize("features", FEATURE_SETS.values(), ids=FEATURE_SETS.keys())
@pytest.mark.parametrize("m,n,k,trans_a", [(9, 400, 130, False), (250, 20, 1024, False), (6, 390, 77, True),
                                           (245, 385, 200, False)])
def test_packing_a_into_scratch_gives_the_same_product(features, m, n, k, trans_a):
    """Wide products and 4 KiB row strides copy A blocks to scratch first; the result must not change."""
    rng = np.random.default_rng(m + n + k)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    b_off = a.nbytes
    c_off = b_off + packed_b_size(k, n)
    scratch = c_off + m * n * 4
    func = gemm_wat(m, n, k, a_offset=0, b_packed_offset=b_off, c_offset=c_off, bias_offset=scratch + gemm_scratch_bytes(m, k),
                       epilogue="relu", features=features, trans_a=trans_a, a_scratch_offset=scratch)
    assert ("$pack_k" in func) == ("simd" in features and (n >= 384 or (not trans_a and k * 4 % 4096 == 0)))
    store, inst = instantiate(func, scratch + gemm_scratch_bytes(m, k) + n * 4, features)
    write(store, inst, 0, a), write(store, inst, b_off, pack_b(b))
    write(store, inst, scratch + gemm_scratch_bytes(m, k), bias)
    inst.exports(store)["gemm"](store)
    want = reference(a.T if trans_a else a, b, bias, None, "relu")
    assert_close(read(store, inst, c_off, (m, n)), want, k)
    assert (read(store, inst, 0, a.shape) == a).all(), "A itself is never written"


@pytest.mark.parametrize("features", [SIMD, SIMD_FMA], ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("m,n,k,batch", [(5, 20, 3, 1), (96, 400, 147, 1), (250, 390, 140, 1), (245, 17, 256, 1),
                                         (7, 33, 300, 3)])
def test_a_packed_at_compile_time_gives_the_same_product_without_packing_at_run_time(features, m, n, k, batch):
    """A weight given as pack_a(A): short last row group, last K block shorter, two row blocks, batches."""
    rng = np.random.default_rng(m * n + k)
    a, b = rng.standard_normal((batch, m, k)).astype(np.float32), rng.standard_normal((batch, k, n)).astype(np.float32)
    bias = rng.standard_normal(batch * m).astype(np.float32)
    packed = np.concatenate([pack_a(a[i]) for i in range(batch)])
    assert packed.nbytes == batch * packed_a_size(m, k)
    b_off = packed.nbytes + 64
    c_off = b_off + batch * packed_b_size(k, n)
    bias_off = c_off + batch * m * n * 4
    func = gemm_wat(m, n, k, a_offset=64, b_packed_offset=b_off, c_offset=c_off, bias_offset=bias_off,
                       bias_per_row=True, epilogue="relu", features=features, a_packed=True, batch=batch,
                       batch_strides=(packed_a_size(m, k), packed_b_size(k, n), m * n * 4))
    assert "$pack_k" not in func
    store, inst = instantiate(func, bias_off + bias.nbytes, features)
    write(store, inst, 64, packed), write(store, inst, b_off, b"".join(pack_b(b[i]) for i in range(batch)))
    write(store, inst, bias_off, bias)
    inst.exports(store)["gemm"](store)
    got = read(store, inst, c_off, (batch, m, n))
    for i in range(batch):
        assert_close(got[i], reference(a[i], b[i], bias[i * m:(i + 1) * m], None, "relu", True), k)


def test_a_packed_a_is_refused_where_the_kernel_reads_a_in_place():
    args = dict(a_offset=0, b_packed_offset=0, c_offset=0, a_packed=True)
    assert not packs_a(4, SIMD_FMA) and not packs_a(64, SCALAR) and packs_a(5, SIMD)
    for bad in (dict(m=4, features=SIMD_FMA), dict(m=64, features=SCALAR), dict(m=64, features=SIMD, trans_a=True)):
        with pytest.raises(ValueError, match="packed A"):
            gemm_wat(n=16, k=16, **args, **bad)


def test_pack_a_lays_out_k_blocks_of_4_row_groups_zero_padded():
    a = np.arange(6 * 170, dtype=np.float32).reshape(6, 170)
    packed = pack_a(a)
    assert packed.size == 8 * 170
    block0 = packed[:8 * 128].reshape(2, 128, 4)      # [row group][k][row]
    assert (block0[0, 5] == a[0:4, 5]).all() and (block0[1, 7, :2] == a[4:6, 7]).all() and (block0[1, :, 2:] == 0).all()
    block1 = packed[8 * 128:].reshape(2, 42, 4)       # the last K block: 42 columns
    assert (block1[1, 41, :2] == a[4:6, 169]).all()


@pytest.mark.parametrize("k,blocks", [(100, 1), (128, 1), (159, 1), (160, 2), (300, 3), (1152, 9)])
def test_a_last_k_block_shorter_than_a_quarter_block_is_not_a_block_of_its_own(k, blocks):
    assert -(-k // k_block_size(k)) == blocks
    a = np.ones((8, k), np.float32)
    assert pack_a(a).size == 8 * k and gemm_scratch_bytes(8, k) == 8 * k_block_size(k) * 4


@pytest.mark.parametrize("tile_rows", [1, 2, 3, 4])
def test_every_tile_height_gives_the_same_product(tile_rows):
    m, n, k = 250, 390, 140  # two row blocks, short last tile, edge panel, two K blocks, packed A
    rng = np.random.default_rng(tile_rows)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    b_off, c_off = a.nbytes, a.nbytes + packed_b_size(k, n)
    scratch = c_off + m * n * 4
    func = gemm_wat(m, n, k, a_offset=0, b_packed_offset=b_off, c_offset=c_off, a_scratch_offset=scratch,
                       tile_rows=tile_rows)
    store, inst = instantiate(func, scratch + gemm_scratch_bytes(m, k, tile_rows), SIMD_FMA)
    write(store, inst, 0, a), write(store, inst, b_off, pack_b(b))
    inst.exports(store)["gemm"](store)
    assert_close(read(store, inst, c_off, (m, n)), reference(a, b), k)


@pytest.mark.parametrize("features", [SIMD, SIMD_FMA], ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed-a", "a-in-place"])
def test_unrolled_k_loop_may_stop_after_any_step(features, packed):
    """Plain products over several K blocks run the tile's k loop unrolled; a last K block of 1 to 8
    steps leaves it after each step in turn."""
    m, n = 9, 40  # two full row tiles and a short one, an edge panel
    for k in range(129, 137):
        rng = np.random.default_rng(k)
        a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        b_off, c_off = a.nbytes, a.nbytes + packed_b_size(k, n)
        scratch = c_off + m * n * 4
        func = gemm_wat(m, n, k, a_offset=0, b_packed_offset=b_off, c_offset=c_off, features=features,
                           a_scratch_offset=scratch if packed else None)
        store, inst = instantiate(func, scratch + gemm_scratch_bytes(m, k), features)
        write(store, inst, 0, a), write(store, inst, b_off, pack_b(b))
        inst.exports(store)["gemm"](store)
        assert_close(read(store, inst, c_off, (m, n)), reference(a, b), k)


def test_packed_a_is_broadcast_from_one_load_per_k_step():
    """With A packed, a 4-row tile reads its four A values for one k as one v128 and splats them by
    shuffles; without packing (A's rows apart) each row is its own scalar load."""
    args = dict(a_offset=0, b_packed_offset=1 << 16, c_offset=1 << 18, features=SIMD_FMA)
    packed = gemm_wat(64, 64, 64, a_scratch_offset=1 << 19, **args)
    in_place = gemm_wat(64, 64, 64, **args)
    assert "(local.set $av (v128.load offset=0 (local.get $pa)))" in packed and "i8x16.shuffle" in packed
    assert "(local.set $av" not in in_place and "f32x4.splat (f32.load" in in_place


def test_gelu_epilogue_is_accurate_over_a_wide_range():
    x = np.linspace(-12, 12, 4001, dtype=np.float32).reshape(1, -1)
    identity = np.eye(1, dtype=np.float32)
    for features in FEATURE_SETS.values():
        got = run_gemm(identity, x, epilogue="gelu", features=features)
        np.testing.assert_allclose(got, reference(identity, x, epilogue="gelu"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("features", [SIMD_FMA, SCALAR], ids=["relaxed-simd", "scalar"])
def test_residual_may_be_c_itself_across_k_blocks(features):
    m, n, k = 7, 35, 300  # three K blocks: C holds partial sums between them
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    func = gemm_wat(m, n, k, a_offset=0, b_packed_offset=a.nbytes, c_offset=a.nbytes + packed_b_size(k, n),
                       residual_offset=a.nbytes + packed_b_size(k, n), features=features)
    store, inst = instantiate(func, a.nbytes + packed_b_size(k, n) + c0.nbytes, features)
    write(store, inst, 0, a), write(store, inst, a.nbytes, pack_b(b))
    write(store, inst, a.nbytes + packed_b_size(k, n), c0)
    inst.exports(store)["gemm"](store)
    assert_close(read(store, inst, a.nbytes + packed_b_size(k, n), (m, n)), reference(a, b, None, c0), k)


@pytest.mark.parametrize("features", FEATURE_SETS.values(), ids=FEATURE_SETS.keys())
def test_batched_gemm_with_strided_rows_and_broadcast_b(features):
    batch, m, n, k, ldc = 3, 5, 20, 33, 24  # C rows padded to 24 columns; B shared by all batches
    rng = np.random.default_rng(5)
    a = rng.standard_normal((batch, m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    b_off = a.nbytes
    c_off = b_off + packed_b_size(k, n)
    func = gemm_wat(m, n, k, a_offset=0, b_packed_offset=b_off, c_offset=c_off, features=features, ldc=ldc,
                       batch=batch, batch_strides=(m * k * 4, 0, m * ldc * 4))
    store, inst = instantiate(func, c_off + batch * m * ldc * 4, features)
    write(store, inst, 0, a), write(store, inst, b_off, pack_b(b))
    sentinel = np.full((batch, m, ldc), 7.0, np.float32)
    write(store, inst, c_off, sentinel)
    inst.exports(store)["gemm"](store)
    c = read(store, inst, c_off, (batch, m, ldc))
    assert_close(c[:, :, :n], np.stack([reference(a[i], b) for i in range(batch)]), k)
    assert (c[:, :, n:] == 7.0).all(), "the padding columns between rows must stay untouched"


@pytest.mark.parametrize("features", [SIMD, SCALAR], ids=["simd", "scalar"])
@pytest.mark.parametrize("k,n,trans_b", [(9, 32, False), (9, 21, False), (5, 7, False), (3, 44, False), (2, 63, False),
                                         (13, 18, True), (4, 48, True)])
def test_runtime_packing_matches_compile_time_packing(features, k, n, trans_b):
    batch = 2
    rng = np.random.default_rng(11)
    src = rng.standard_normal((batch, n, k) if trans_b else (batch, k, n)).astype(np.float32)
    dst = src.nbytes + 32
    func = render_pack_b(k, n, src_offset=0, dst_offset=dst, trans_b=trans_b, batch=batch, features=features)
    store, inst = instantiate(func, dst + batch * packed_b_size(k, n), features)
    write(store, inst, 0, src)
    write(store, inst, dst, np.full(batch * packed_b_size(k, n) // 4, np.nan, np.float32))
    inst.exports(store)["pack_b"](store)
    raw = inst.exports(store)["memory"].read(store, dst, dst + batch * packed_b_size(k, n))
    assert bytes(raw) == b"".join(pack_b(src[i], trans_b=trans_b) for i in range(batch))


def test_pack_b_lays_out_16_column_panels_zero_padded():
    b = np.arange(3 * 20, dtype=np.float32).reshape(3, 20)
    panels = np.frombuffer(pack_b(b), dtype="<f4").reshape(2, 3, 16)
    assert (panels[0] == b[:, :16]).all()
    assert (panels[1, :, :4] == b[:, 16:]).all() and (panels[1, :, 4:] == 0).all()
    assert len(pack_b(b)) == packed_b_size(3, 20)
    assert pack_b(b.T, trans_b=True) == pack_b(b)


def test_relaxed_simd_uses_fma_and_plain_simd_does_not():
    fma = gemm_wat(8, 32, 16, a_offset=0, b_packed_offset=512, c_offset=4096, features=SIMD_FMA)
    plain = gemm_wat(8, 32, 16, a_offset=0, b_packed_offset=512, c_offset=4096, features=SIMD)
    scalar = gemm_wat(8, 32, 16, a_offset=0, b_packed_offset=512, c_offset=4096, features=SCALAR)
    assert "f32x4.relaxed_madd" in fma and "f32x4.relaxed_madd" not in plain
    assert "f32x4.splat (f32.load" in fma and "load32_splat" not in fma  # A in place: a scalar load per row
    assert "v128" not in scalar


def test_rendering_is_deterministic():
    args = dict(a_offset=16, b_packed_offset=4096, c_offset=65536, bias_offset=128, epilogue="gelu")
    assert gemm_wat(13, 70, 200, **args) == gemm_wat(13, 70, 200, **args)


@pytest.mark.parametrize("bad", [dict(features={"avx"}), dict(features={"relaxed-simd"}), dict(epilogue="tanh"),
                                 dict(tile_rows=5), dict(tile_rows=0)])
def test_bad_kernel_requests_are_refused(bad):
    with pytest.raises(ValueError):
        gemm_wat(2, 2, 2, a_offset=0, b_packed_offset=64, c_offset=128, **bad)


EPILOGUE_COMBINATIONS = [  # (bias, residual, epilogue): every combination the models produce and then some
    (bias, residual, epilogue) for bias in (None, "column", "row") for residual in (False, True)
    for epilogue in (None, "relu", "gelu")]


@pytest.mark.parametrize("bias_mode,with_residual,epilogue", EPILOGUE_COMBINATIONS,
                         ids=[f"{b or 'no'}-bias{'-residual' if r else ''}-{e or 'identity'}" for b, r, e in EPILOGUE_COMBINATIONS])
@pytest.mark.parametrize("m,n,k", [(16, 64, 300), (250, 40, 128), (9, 48, 7)])
def test_every_epilogue_is_right_when_the_k_loop_is_its_own_function(bias_mode, with_residual, epilogue, m, n, k):
    """With relaxed SIMD and packed A, 4-row tiles call a function for their k loop: bias and residual
    go into C before it on the first K block, the activation runs over the tile after the last one.
    Shapes: three K blocks, one full K block with two row blocks and an edge panel, one short block."""
    rng = np.random.default_rng(m * n + k)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(m if bias_mode == "row" else n).astype(np.float32) if bias_mode else None
    res = rng.standard_normal((m, n)).astype(np.float32) if with_residual else None
    offsets, end = {}, 64
    for key, size in (("a", a.nbytes), ("b", packed_b_size(k, n)), ("c", m * n * 4), ("bias", max(m, n) * 4),
                      ("res", m * n * 4), ("scratch", gemm_scratch_bytes(m, k))):
        offsets[key], end = end, end + size + 16
    func = gemm_wat(m, n, k, a_offset=offsets["a"], b_packed_offset=offsets["b"], c_offset=offsets["c"],
                       bias_offset=offsets["bias"] if bias is not None else None, bias_per_row=bias_mode == "row",
                       residual_offset=offsets["res"] if res is not None else None, epilogue=epilogue,
                       a_scratch_offset=offsets["scratch"], features=SIMD_FMA)
    assert "(func $gemm_k_acc" in func and "(call $gemm_k_" in func
    store, inst = instantiate(func, end, SIMD_FMA)
    write(store, inst, offsets["a"], a), write(store, inst, offsets["b"], pack_b(b))
    write(store, inst, offsets["c"], np.full((m, n), np.nan, np.float32))
    if bias is not None:
        write(store, inst, offsets["bias"], bias)
    if res is not None:
        write(store, inst, offsets["res"], res)
    inst.exports(store)["gemm"](store)
    assert_close(read(store, inst, offsets["c"], (m, n)), reference(a, b, bias, res, epilogue, bias_mode == "row"), k)


@pytest.mark.parametrize("epilogue", [None, "gelu"])
def test_in_place_residual_survives_the_k_function(epilogue):
    """C = act(A @ B + C) across three K blocks on the function path: the residual is read before the
    first block's sums overwrite it."""
    m, n, k = 12, 32, 300
    rng = np.random.default_rng(13)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    c_off = a.nbytes + packed_b_size(k, n)
    scratch = c_off + c0.nbytes
    func = gemm_wat(m, n, k, a_offset=0, b_packed_offset=a.nbytes, c_offset=c_off, residual_offset=c_off,
                       epilogue=epilogue, a_scratch_offset=scratch, features=SIMD_FMA)
    assert "(call $gemm_k_acc" in func
    store, inst = instantiate(func, scratch + gemm_scratch_bytes(m, k), SIMD_FMA)
    write(store, inst, 0, a), write(store, inst, a.nbytes, pack_b(b)), write(store, inst, c_off, c0)
    inst.exports(store)["gemm"](store)
    assert_close(read(store, inst, c_off, (m, n)), reference(a, b, None, c0, epilogue), k)


def test_k_function_is_used_only_with_relaxed_simd_and_packed_a():
    """Measured faster only with FMA (see `_k_function_unroll`); mul + add keeps the inline loop, and A
    read in place has no one-load tile to call it for."""
    args = dict(a_offset=0, b_packed_offset=1 << 16, c_offset=1 << 18, bias_offset=64, epilogue="relu")
    assert "(call $gemm_k_" in gemm_wat(64, 64, 256, a_scratch_offset=1 << 19, features=SIMD_FMA, **args)
    assert "$gemm_k_" not in gemm_wat(64, 64, 256, a_scratch_offset=1 << 19, features=SIMD, **args)
    assert "$gemm_k_" not in gemm_wat(64, 64, 256, features=SIMD_FMA, **args)
    assert "$gemm_k_" not in gemm_wat(64, 64, 256, a_scratch_offset=1 << 19, features=SCALAR, **args)


@pytest.mark.parametrize("edge", range(1, 16))
def test_edge_panels_of_every_width_run_their_own_k_functions(edge):
    """An edge panel's passes (1 vector, or 2 with a partial one) call k functions rendered for their
    widths; one vector sums its even and odd k steps apart, so K of both parities over 2 blocks."""
    m, n = 8, 16 + edge
    for k in (135, 136):
        rng = np.random.default_rng(edge * 1000 + k)
        a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        bias, res = rng.standard_normal(m).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
        offsets, end = {}, 64
        for key, size in (("a", a.nbytes), ("b", packed_b_size(k, n)), ("c", m * n * 4), ("bias", m * 4),
                          ("res", m * n * 4), ("scratch", gemm_scratch_bytes(m, k))):
            offsets[key], end = end, end + size + 16
        func = gemm_wat(m, n, k, a_offset=offsets["a"], b_packed_offset=offsets["b"], c_offset=offsets["c"],
                           bias_offset=offsets["bias"], bias_per_row=True, residual_offset=offsets["res"],
                           epilogue="gelu", a_scratch_offset=offsets["scratch"], features=SIMD_FMA)
        widths = ["".join(map(str, lanes)) for lanes in edge_pass_lanes(edge)]  # edge 8: one whole pair
        assert "(call $gemm_k_acc" in func and all(f"(call $gemm_k_{w}_acc" in func for w in widths)
        store, inst = instantiate(func, end, SIMD_FMA)
        write(store, inst, offsets["a"], a), write(store, inst, offsets["b"], pack_b(b))
        write(store, inst, offsets["c"], np.full((m, n), np.nan, np.float32))
        write(store, inst, offsets["bias"], bias), write(store, inst, offsets["res"], res)
        inst.exports(store)["gemm"](store)
        assert_close(read(store, inst, offsets["c"], (m, n)), reference(a, b, bias, res, "gelu", True), k)


@pytest.mark.parametrize("features", [SIMD, SIMD_FMA], ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("a_packed", [True, False], ids=["a-packed", "a-packed-at-run-time"])
@pytest.mark.parametrize("m,n,k,batch", [(250, 16 * 37 + 5, 300, 1), (20, 16 * 40, 1024, 2), (9, 16 * 33 + 1, 140, 1)])
def test_column_chunks_give_the_same_product(monkeypatch, features, a_packed, m, n, k, batch):
    """C larger than the chunk goes in column chunks, each over every K block: two row blocks, an edge
    panel after the chunks, a last chunk shorter than the others, batches, a residual read before C
    is written; one K block (k = 140) never chunks."""
    monkeypatch.setattr(gemm, "C_CHUNK_BYTES", 1 << 13)
    rng = np.random.default_rng(m + n + k)
    a, b = rng.standard_normal((batch, m, k)).astype(np.float32), rng.standard_normal((batch, k, n)).astype(np.float32)
    bias, res = rng.standard_normal(batch * m).astype(np.float32), rng.standard_normal((batch, m, n)).astype(np.float32)
    a_blob = np.concatenate([pack_a(a[i]) for i in range(batch)]) if a_packed else a
    a_stride = packed_a_size(m, k) if a_packed else m * k * 4
    b_off = a_blob.nbytes + 64
    c_off = b_off + batch * packed_b_size(k, n)
    res_off = c_off + batch * m * n * 4
    bias_off = res_off + res.nbytes
    scratch_off = bias_off + bias.nbytes
    func = gemm_wat(m, n, k, a_offset=64, b_packed_offset=b_off, c_offset=c_off, bias_offset=bias_off,
                    residual_offset=res_off, a_scratch_offset=None if a_packed else scratch_off, bias_per_row=True,
                    epilogue="relu", features=features, a_packed=a_packed, batch=batch,
                    batch_strides=(a_stride, packed_b_size(k, n), m * n * 4))
    assert ("$loop_j0" in func) == (k > 160)
    store, inst = instantiate(func, scratch_off + gemm_scratch_bytes(m, k), features)
    write(store, inst, 64, a_blob), write(store, inst, b_off, b"".join(pack_b(b[i]) for i in range(batch)))
    write(store, inst, c_off, np.full((batch, m, n), np.nan, np.float32))
    write(store, inst, res_off, res), write(store, inst, bias_off, bias)
    inst.exports(store)["gemm"](store)
    got = read(store, inst, c_off, (batch, m, n))
    for i in range(batch):
        assert_close(got[i], reference(a[i], b[i], bias[i * m:(i + 1) * m], res[i], "relu", True), k)
