"""The WebAssembly kernel of MatMulNBits at accuracy level 4 (backends/wasm/kernels/block_quant.py)
run on its own, against numpy computing what MLAS computes: A quantized per block to int8, integer
sums of qa * (code - zero) per block, scaled by both scales and summed over the blocks."""

from __future__ import annotations

import numpy as np
import pytest

from backends.wasm.gemm import gemm_scratch_bytes, pack_b, render_gemm
from backends.wasm.kernels.block_quant import (BlockQuantOffsets, pack_block_quant_b, packed_size,
                                               render_block_quant_gemm, scratch_bytes)
from backends.wasm.kernels.block_quant_panels import pack_block_quant_panels, uses_gemm_tiles
from backends.wasm.kernels.operands import GemmLayout, GemmOffsets
from backends.wasm.kernels.standalone import instantiate, read, write
from ir.loops.contraction import BlockQuantGemmSpec, BlockQuantWeight, EpilogueSpec, GemmSpec

RNG = np.random.default_rng(5)
FEATURES = {"simd": frozenset({"simd"}), "relaxed": frozenset({"simd", "relaxed-simd"})}


def reference(a: np.ndarray, weight: BlockQuantWeight, block: int) -> np.ndarray:
    m, k = a.shape
    blocks = -(-k // block)
    padded = np.zeros((m, blocks * block), np.float32)
    padded[:, :k] = a
    rows = padded.reshape(m, blocks, block)
    amax = np.abs(rows).max(axis=2)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0).astype(np.float32)
    codes_a = np.rint(rows * inverse[:, :, None]).astype(np.int64)
    scale_a = (amax / np.float32(127)).astype(np.float32)
    n = weight.codes.shape[0]
    codes_b = np.zeros((n, blocks * block), np.int64)
    codes_b[:, :k] = weight.codes
    zeros = weight.zeros if weight.zeros is not None else np.full((n, blocks), 2 ** (weight.bits - 1))
    centred = codes_b.reshape(n, blocks, block) - zeros.astype(np.int64)[:, :, None]
    sums = np.einsum("mbk,nbk->mnb", codes_a, centred).astype(np.float32)
    out = np.zeros((m, n), np.float32)
    for blk in range(blocks):   # block after block in float32, as the kernel adds them
        out += sums[:, :, blk] * (scale_a[:, blk][:, None] * weight.scales[:, blk][None, :])
    return out


def random_weight(bits: int, n: int, k: int, block: int, zero_points: bool) -> BlockQuantWeight:
    blocks = -(-k // block)
    return BlockQuantWeight(RNG.integers(0, 2 ** bits, (n, k), dtype=np.uint8),
                            (RNG.random((n, blocks)) * 0.1 + 0.01).astype(np.float32),
                            RNG.integers(0, 2 ** bits, (n, blocks), dtype=np.uint8) if zero_points else None, bits)


def run_kernel(spec: BlockQuantGemmSpec, a, weight, bias, features) -> np.ndarray:
    packed = pack_block_quant_b(spec, weight)
    assert packed.size == packed_size(spec)
    a_at = 0
    b_at = a_at + a.nbytes
    c_at = b_at + packed.size + 16
    bias_at = c_at + spec.m * spec.n * 4
    scratch_at = bias_at + spec.n * 4 + 16
    at = BlockQuantOffsets(a_at, b_at, c_at, scratch_at, bias=bias_at if bias is not None else None)
    store, instance = instantiate(render_block_quant_gemm(spec, at, features=features, name="kernel"),
                                  scratch_at + scratch_bytes(spec) + 64, features)
    write(store, instance, a_at, a)
    write(store, instance, b_at, packed.tobytes())
    if bias is not None:
        write(store, instance, bias_at, bias)
    instance.exports(store)["kernel"](store)
    return read(store, instance, c_at, (spec.m, spec.n))


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("bits,m,k,n,block,zero_points,bias", [
    (4, 1, 64, 16, 32, False, False), (4, 2, 80, 40, 32, True, True), (4, 3, 300, 17, 128, True, False),
    (4, 1, 256, 64, 16, False, True), (4, 1, 512, 33, 256, True, False), (4, 2, 96, 16, 64, False, False),
    (8, 1, 64, 16, 16, True, False), (8, 3, 100, 21, 32, False, True), (8, 1, 256, 48, 128, True, True),
])
def test_kernel_matches_the_integer_arithmetic(features, bits, m, k, n, block, zero_points, bias):
    weight = random_weight(bits, n, k, block, zero_points)
    a = RNG.standard_normal((m, k)).astype(np.float32)
    a[0, :min(k, block)] = 0.0           # an all-zero block: scale 0, codes 0
    b = RNG.standard_normal(n).astype(np.float32) if bias else None
    spec = BlockQuantGemmSpec(m, n, k, bits, block, zero_points, True)
    got = run_kernel(spec, a, weight, b, FEATURES[features])
    want = reference(a, weight, block) + (b if b is not None else 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def float_reference(a: np.ndarray, weight: BlockQuantWeight, block: int) -> np.ndarray:
    k = a.shape[1]
    zeros = weight.zeros if weight.zeros is not None else np.full(weight.scales.shape, 2 ** (weight.bits - 1))
    group = np.arange(k) // block
    dequantized = (weight.codes.astype(np.float64) - zeros[:, group]) * weight.scales[:, group]
    return (a.astype(np.float64) @ dequantized.T).astype(np.float32)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("bits,m,k,n,block,zero_points,bias", [
    (4, 1, 64, 16, 32, False, False), (4, 2, 80, 40, 32, True, True), (4, 3, 300, 17, 128, True, False),
    (4, 1, 512, 33, 256, True, False), (8, 1, 64, 16, 16, True, False), (8, 3, 100, 21, 32, False, True),
])
def test_weight_only_kernel_is_the_dequantized_product_to_float32_rounding(features, bits, m, k, n, block,
                                                                          zero_points, bias):
    weight = random_weight(bits, n, k, block, zero_points)
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal(n).astype(np.float32) if bias else None
    got = run_kernel(BlockQuantGemmSpec(m, n, k, bits, block, zero_points, False), a, weight, b, FEATURES[features])
    want = float_reference(a, weight, block) + (b if b is not None else 0)
    # float32 rounding of sums of k products, each of size |a| * 2^bits * scale
    bound = 4 * np.finfo(np.float32).eps * np.sqrt(k) * 2 ** bits * 0.11 * np.abs(a).max() * 4
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("bits,m,k,n,block,zero_points,bias", [
    (4, 3, 64, 16, 32, False, False), (4, 9, 80, 40, 32, True, True), (4, 17, 300, 17, 128, True, False),
    (4, 8, 512, 33, 256, False, False), (8, 5, 100, 21, 16, True, True), (4, 250, 192, 48, 64, True, False),
])
def test_more_than_two_rows_run_the_gemm_tiles_over_exactly_dequantized_blocks(features, bits, m, k, n, block,
                                                                               zero_points, bias):
    weight = random_weight(bits, n, k, block, zero_points)
    spec = BlockQuantGemmSpec(m, n, k, bits, block, zero_points, False, EpilogueSpec(bias=bias))
    assert uses_gemm_tiles(spec)
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal(n).astype(np.float32) if bias else None
    packed = pack_block_quant_panels(spec, weight)
    c_at = a.nbytes + packed.size + 16
    bias_at = c_at + m * n * 4
    scratch_at = bias_at + n * 4 + 16
    at = GemmOffsets(0, a.nbytes, c_at, bias=bias_at if bias else None, a_scratch=scratch_at)
    wat = render_gemm(GemmSpec(m, n, k, epilogue=spec.epilogue, b_format=f"q{bits}"), at,
                      features=FEATURES[features], layout=GemmLayout(b_block=block), name="kernel")
    store, instance = instantiate(wat, scratch_at + gemm_scratch_bytes(m, k, b_format=f"q{bits}") + 64, FEATURES[features])
    write(store, instance, 0, a)
    write(store, instance, a.nbytes, packed.tobytes())
    if bias:
        write(store, instance, bias_at, b)
    instance.exports(store)["kernel"](store)
    got = read(store, instance, c_at, (m, n))
    # the float32 GEMM on the dequantized weight, which the tiles read exactly
    dequantized = weight.dequantized(block)
    want = run_float_gemm(a, dequantized, b, features)
    np.testing.assert_array_equal(got, want)


def run_float_gemm(a: np.ndarray, b: np.ndarray, bias, features: str) -> np.ndarray:
    """The float32 GEMM kernel on the same operands."""
    (m, k), n = a.shape, b.shape[1]
    packed = pack_b(b)
    c_at = a.nbytes + len(packed) + 16
    bias_at = c_at + m * n * 4
    scratch_at = bias_at + n * 4 + 16
    at = GemmOffsets(0, a.nbytes, c_at, bias=bias_at if bias is not None else None, a_scratch=scratch_at)
    wat = render_gemm(GemmSpec(m, n, k, epilogue=EpilogueSpec(bias=bias is not None)), at, features=FEATURES[features],
                      name="kernel")
    store, instance = instantiate(wat, scratch_at + gemm_scratch_bytes(m, k) + 64, FEATURES[features])
    write(store, instance, 0, a)
    write(store, instance, a.nbytes, packed)
    if bias is not None:
        write(store, instance, bias_at, bias)
    instance.exports(store)["kernel"](store)
    return read(store, instance, c_at, (m, n))
