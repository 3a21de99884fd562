"""bf16, fp16 and int8 variant weights read narrow by the WASM GEMV and GEMM: a MatMul's or Gemm's B
widened by a `--variants` build (Cast, and Mul by the per-channel scale for int8) is packed narrow,
the widening disappears from the module, the module holds about half (bf16, fp16) or a quarter (int8)
of the weight bytes, and the outputs are onnxruntime's on the variant's own graph (the Cast/Mul one),
with a fused bias, residual and Relu too. Without SIMD the widening and the float32 loops stay."""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
import wasmtime
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from backends.wasm.assemble import make_engine
from backends.wasm.compile import compile_graph
from backends.wasm.instance import WasmInstance
from backends.wasm.options import parse_options
from ir.onnx_export import export_model
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.narrow_weights import narrowed
from wasm_cases import make_model

FEATURES = ["simd,bulk-memory", "simd,bulk-memory,relaxed-simd"]


def matmul_model(m: int, k: int, n: int, *, gemm: bool = False, trans_a: bool = False, seed: int = 0):
    """y = x @ W (+ bias as a Gemm with transB, W then stored [n, k]; with `trans_a`, x stored [k, m])."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k) if gemm else (k, n)) / np.sqrt(k)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    if gemm:
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias"))
        node = helper.make_node("Gemm", ["x", "w", "bias"], ["y"], transB=1, transA=int(trans_a))
    else:
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
    return make_model([node], [helper.make_tensor_value_info("x", T.FLOAT, [k, m] if trans_a else [m, k])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [m, n])], inits)


def block_model(m: int, k: int, n: int, *, seed: int = 0):
    """y = Relu(x @ W + bias + r): the product with every epilogue the kernels fuse."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "bias"], ["q"]),
             helper.make_node("Add", ["q", "r"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    return make_model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [m, k]),
                              helper.make_tensor_value_info("r", T.FLOAT, [m, n])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [m, n])],
                      [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias")])


def variant_graph(model, precision: str):
    """The variant's weight-only form for every product (int8's GEMM-shaped products otherwise run on
    the integer GEMM: tests/test_int8_variant_gemm.py), the form whose narrow panels are tested here."""
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return narrowed(graph, precision, integer_gemm=False)


def compiled(graph, features: str):
    return compile_graph(graph, parse_options(None, features, "2"))


def run(artifact, features: str, feeds: dict) -> np.ndarray:
    engine = make_engine(parse_options(None, features, "2"))
    instance = WasmInstance(engine, wasmtime.Module(engine, artifact.wasm), artifact.plan)
    return np.array(instance.run(feeds)["y"])


def kernels(artifact) -> list[str]:
    """The ops of the module's kernels, in the order they run."""
    return re.findall(r"^  \(func \$(?!load_weights)([A-Za-z]+)_\S+ ;; ", artifact.wat, flags=re.M)


def onnxruntime_on(graph, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(export_model(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("features", FEATURES, ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("m,k,n,gemm,trans_a", [
    (1, 37, 50, False, False), (2, 130, 33, False, False), (1, 64, 16, True, False), (2, 23, 70, True, False),
    # the GEMM's tiles: one short tile (A read in place), A^T, packed A over one and several K blocks,
    # edge panels of 1 to 15 columns, a short last row tile
    (3, 37, 50, False, False), (4, 19, 40, True, False), (4, 64, 48, True, True), (8, 130, 33, False, False),
    (16, 200, 70, True, False), (16, 301, 36, True, True), (64, 301, 45, False, False), (64, 96, 128, True, False),
    (13, 170, 23, False, False)])
def test_a_variant_product_computes_what_onnxruntime_computes_on_the_variant_graph(m, k, n, gemm, trans_a,
                                                                                   precision, features):
    graph = variant_graph(matmul_model(m, k, n, gemm=gemm, trans_a=trans_a, seed=m + k + n), precision)
    feeds = {"x": np.random.default_rng(k).standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)}
    want = onnxruntime_on(graph, feeds)
    artifact = compiled(graph, features)
    got = run(artifact, features, feeds)
    # int8 scales each column's sum once instead of each product: float32 rounding apart, equal.
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
    assert kernels(artifact) == ["Gemm" if gemm else "MatMul"], "the widening still runs"


@pytest.mark.parametrize("features", FEATURES, ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("m,k,n", [(3, 37, 50), (8, 200, 40), (64, 301, 45)])
def test_bias_residual_and_relu_see_the_scaled_product(m, k, n, precision, features):
    graph = variant_graph(block_model(m, k, n, seed=m + k), precision)
    rng = np.random.default_rng(k)
    feeds = {"x": rng.standard_normal((m, k)).astype(np.float32), "r": rng.standard_normal((m, n)).astype(np.float32)}
    want = onnxruntime_on(graph, feeds)
    artifact = compiled(graph, features)
    got = run(artifact, features, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert kernels(artifact) == ["MatMul"], "the epilogue or the widening runs apart"


@pytest.mark.parametrize("precision,ratio", [("bf16", 0.5), ("fp16", 0.5), ("int8", 0.25)])
def test_products_read_the_narrow_weight_with_no_widening(precision, ratio):
    k, n = 256, 384
    for m in (1, 2, 16):
        exact, _ = run_pipeline(import_model(matmul_model(m, k, n)), optimize_pipeline(require_static=True))
        f32 = compiled(exact, "simd,bulk-memory,relaxed-simd")
        variant = compiled(variant_graph(matmul_model(m, k, n), precision), "simd,bulk-memory,relaxed-simd")
        weight_bytes = k * n * 4
        # int8 also stores one float32 scale per column
        assert len(variant.wasm) - len(f32.wasm) == pytest.approx((ratio - 1) * weight_bytes, abs=4 * n + 2048)
        assert kernels(variant) == ["MatMul"], "the widening still runs"
        assert f"({precision})" in variant.wat      # the kernel's title names the format it reads


def test_without_simd_the_widening_and_the_float32_loops_stay():
    graph = variant_graph(matmul_model(4, 64, 48), "bf16")
    variant = compiled(graph, "bulk-memory")
    assert kernels(variant) == ["Cast", "MatMul"] and "(bf16)" not in variant.wat
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)}
    want = onnxruntime_on(graph, feeds)
    np.testing.assert_allclose(run(variant, "bulk-memory", feeds), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
