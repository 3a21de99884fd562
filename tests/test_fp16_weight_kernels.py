"""fp16 weights read narrow: SIMD128 has no float16 conversion, so the GEMV and the GEMM widen each
half with integer ops and one multiply by 2^112 (kernels/narrow_panels.py). Every finite float16,
subnormals, zeros and the largest magnitudes included, must come out as the float32 numpy widens it
to; a weight that rounded to Inf keeps its Cast; and a `compile-wasm --variants fp16` build ships
products that read the fp16 constant (no Cast before them) and compute what onnxruntime computes on
the variant's graph."""

from __future__ import annotations

import json

import numpy as np
import pytest
import wasmtime
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from backends.wasm.assemble import make_engine
from backends.wasm.compile import compile_graph
from backends.wasm.gemm import SIMD_FMA, gemm_scratch_bytes, render_gemm
from backends.wasm.instance import WasmInstance
from backends.wasm.kernels.gemv import render_gemv
from backends.wasm.kernels.narrow_panels import pack_narrow_b, packed_narrow_size
from backends.wasm.kernels.operands import GemmOffsets
from backends.wasm.kernels.standalone import instantiate, read, write
from backends.wasm.options import parse_options
from cortex.compile import load_cu_graphs
from ir.dtypes import to_numpy
from ir.loops.contraction import GemmSpec
from ir.loops.narrow_weights import NarrowWeight
from passes.narrow_weights import narrowed
from test_narrow_weight_kernels import compiled, kernels, onnxruntime_on, run, variant_graph
from variant_cases import build
from wasm_cases import make_model

FEATURES = [frozenset({"simd"}), SIMD_FMA]


def every_finite_half(k: int) -> np.ndarray:
    """All 63488 finite float16 values, as a [k, 63488 / k] weight."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    return halves[np.isfinite(halves)].reshape(k, -1)


def product(b: np.ndarray, a: np.ndarray, features, *, gemv: bool) -> np.ndarray:
    """a @ b by the GEMV (one or two rows) or the GEMM, B packed as fp16 panels."""
    (m, k), n = a.shape, b.shape[1]
    spec = GemmSpec(m, n, k, b_format="fp16")
    a_at = 64
    c_at = a_at + a.nbytes + 64
    scratch_at = c_at + m * n * 4 + 64
    b_at = scratch_at + gemm_scratch_bytes(m, k, b_format="fp16") + 64
    if gemv:
        wat = render_gemv(spec, GemmOffsets(a_at, b_at, c_at), features=features)
    else:
        wat = render_gemm(spec, GemmOffsets(a_at, b_at, c_at, a_scratch=scratch_at), features=features)
    assert "(fp16)" in wat
    store, instance = instantiate(wat, b_at + packed_narrow_size("fp16", k, n) + 64, features)
    write(store, instance, a_at, a)
    write(store, instance, b_at, pack_narrow_b(NarrowWeight("fp16", b, None, ())).tobytes())
    instance.exports(store)["gemv" if gemv else "gemm"](store)
    return read(store, instance, c_at, (m, n))


@pytest.mark.parametrize("features", FEATURES, ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("m,gemv", [(1, True), (2, True), (6, False)])
def test_every_finite_half_widens_to_its_exact_float32(m, gemv, features):
    k = min(m, 2)
    b = every_finite_half(k)
    # Rows of A pick one row of B each (1 * b + 0 * other): C's rows are B's widened rows, exactly.
    picked = np.arange(m) % k
    got = product(b, np.eye(k, dtype=np.float32)[picked], features, gemv=gemv)
    want = b.astype(np.float32)[picked]
    mismatched = np.flatnonzero((got != want).any(axis=0))
    assert mismatched.size == 0, f"{b[:, mismatched[:4]]} widened to {got[:k, mismatched[:4]]}"
    extremes = np.float32([2.0 ** -24, -(2.0 ** -24), 1023 * 2.0 ** -24, 2.0 ** -14, 65504.0, -65504.0])
    assert np.isin(extremes, got).all()     # the smallest and largest subnormals, min normal, max


@pytest.mark.parametrize("gemv", [True, False], ids=["gemv", "gemm"])
def test_subnormal_and_extreme_weights_in_a_product_sum_as_float32_does(gemv):
    m, k, n = (1, 67, 53) if gemv else (9, 67, 53)
    rng = np.random.default_rng(5)
    pool = np.float16([2.0 ** -24, -(2.0 ** -24), 2.0 ** -20, 6.1e-5, -6.1e-5, 65504, -65504, 0, -0.0, 1.5])
    b = rng.choice(pool, size=(k, n)).astype(np.float16)
    a = rng.standard_normal((m, k)).astype(np.float32) * np.float32(1e-3)
    got = product(b, a, SIMD_FMA, gemv=gemv)
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_a_weight_that_rounds_to_inf_in_fp16_keeps_its_cast():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((64, 40)) / 8).astype(np.float32)
    w[3, 5] = 1e6           # beyond float16's 65504: the fp16 constant holds Inf
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [helper.make_tensor_value_info("x", T.FLOAT, [2, 64])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [2, 40])], [numpy_helper.from_array(w, "w")])
    graph = variant_graph(model, "fp16")
    artifact = compiled(graph, "simd,bulk-memory,relaxed-simd")
    assert kernels(artifact) == ["Cast", "MatMul"] and "(fp16)" not in artifact.wat
    feeds = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    want = onnxruntime_on(graph, feeds)
    assert np.isinf(want[:, 5]).all()
    np.testing.assert_allclose(run(artifact, "simd,bulk-memory,relaxed-simd", feeds), want, rtol=1e-5, atol=1e-5)


def test_a_variants_fp16_build_reads_its_weights_narrow_and_matches_onnxruntime(tmp_path):
    dag_path = build(tmp_path, variants=("fp16",))
    dag = json.loads(dag_path.read_text())
    products = 0
    for cu in dag["cus"]:
        if "fp16" not in cu.get("variants", {}):
            continue
        graph = load_cu_graphs(dag_path.parent, [cu], "wasm")[cu["id"]]
        variant = narrowed(graph, "fp16")
        artifact = compile_graph(variant, parse_options(None, "simd", "2"))
        shipped = (dag_path.parent / cu["variants"]["fp16"]["artifacts"]["wasm"]["path"]).read_bytes()
        assert artifact.wasm == shipped       # what the test runs is what the build wrote
        ops = kernels(artifact)
        if {"MatMul", "Gemm"} & set(cu["op_types"]):
            products += 1
            assert "Cast" not in ops and "(fp16)" in artifact.wat, ops
        rng = np.random.default_rng(products)
        feeds = {v.name: (rng.integers(0, 1000, v.shape) if to_numpy(v.dtype) == np.int64
                          else rng.standard_normal(v.shape)).astype(to_numpy(v.dtype)) for v in variant.inputs}
        engine = make_engine(parse_options(None, "simd", "2"))
        instance = WasmInstance(engine, wasmtime.Module(engine, artifact.wasm), artifact.plan)
        got = instance.run(feeds)
        want = onnxruntime_on(variant, feeds)     # onnxruntime on the fp16 variant's cu.onnx
        out = variant.outputs[0].name
        np.testing.assert_allclose(np.array(got[out]), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert products == 2      # the MatMul's CU and the Gemm's (transB)
