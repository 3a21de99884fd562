"""The WebAssembly kernel of MatMulNBits at accuracy level 4 (backends/wasm/kernels/block_quant.py)
run on its own, against numpy computing what MLAS computes: A quantized per block to int8, integer
sums of qa * (code - zero) per block, scaled by both scales and summed over the blocks."""

from __future__ import annotations

import numpy as np
import pytest

from backends.wasm.kernels.block_quant import (BlockQuantOffsets, pack_block_quant_b, packed_size,
                                               render_block_quant_gemm, scratch_bytes)
from backends.wasm.kernels.standalone import instantiate, read, write
from ir.loops.contraction import BlockQuantGemmSpec, BlockQuantWeight

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
    blocks = -(-k // block)
    weight = BlockQuantWeight(RNG.integers(0, 2 ** bits, (n, k), dtype=np.uint8),
                              (RNG.random((n, blocks)) * 0.1 + 0.01).astype(np.float32),
                              RNG.integers(0, 2 ** bits, (n, blocks), dtype=np.uint8) if zero_points else None, bits)
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
    blocks = -(-k // block)
    weight = BlockQuantWeight(RNG.integers(0, 2 ** bits, (n, k), dtype=np.uint8),
                              (RNG.random((n, blocks)) * 0.1 + 0.01).astype(np.float32),
                              RNG.integers(0, 2 ** bits, (n, blocks), dtype=np.uint8) if zero_points else None, bits)
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal(n).astype(np.float32) if bias else None
    got = run_kernel(BlockQuantGemmSpec(m, n, k, bits, block, zero_points, False), a, weight, b, FEATURES[features])
    want = float_reference(a, weight, block) + (b if b is not None else 0)
    # float32 rounding of sums of k products, each of size |a| * 2^bits * scale
    bound = 4 * np.finfo(np.float32).eps * np.sqrt(k) * 2 ** bits * 0.11 * np.abs(a).max() * 4
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)
