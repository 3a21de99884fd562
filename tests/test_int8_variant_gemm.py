"""The int8 variant's GEMM-shaped products multiply integers: a MatMul or Gemm whose A has more than
two rows becomes DynamicQuantizeLinear(A) -> MatMulInteger(codes) -> Cast -> Mul(a_scale * scale)
[-> Add(bias)], which runs as the wasm integer GEMM with its dequantizing epilogue (no loop nest,
no separate Cast / Mul kernel) and computes what onnxruntime's DynamicQuantizeMatMul computes on
the weight's per-channel int8 codes. One or two rows keep the weight-only form the GEMV reads."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from test_narrow_weight_kernels import FEATURES, compiled, kernels, run
from testdata import run_onnxruntime
from wasm_cases import make_model

from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.narrow_weights import narrowed

INTEGER_FORM = ["DynamicQuantizeLinear", "Mul", "MatMulInteger", "Cast", "Mul"]


def product_model(a_shape: tuple, n: int, *, gemm: dict | None = None, bias: str | None = None, seed: int = 0):
    """y = x @ W (MatMul, any rank of x), or Gemm(x, W, C) with `gemm`'s attributes (transB: W is
    stored [n, k]; transA: x is stored [k, m]); `bias`: "const" (C an initializer of [n]) or "input" (C fed at run time, [m, n])."""
    rng = np.random.default_rng(seed)
    k = a_shape[0] if gemm and gemm.get("transA") else a_shape[-1]
    trans_b = bool(gemm and gemm.get("transB"))
    w = (rng.standard_normal((n, k) if trans_b else (k, n)) / np.sqrt(k)).astype(np.float32)
    inits, inputs = [numpy_helper.from_array(w, "w")], [helper.make_tensor_value_info("x", T.FLOAT, list(a_shape))]
    out_shape = [a_shape[1] if gemm and gemm.get("transA") else a_shape[0], n] if gemm else [*a_shape[:-1], n]
    if gemm is None:
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
    else:
        names = ["x", "w"]
        if bias == "const":
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "c"))
            names.append("c")
        elif bias == "input":
            inputs.append(helper.make_tensor_value_info("c", T.FLOAT, out_shape))
            names.append("c")
        node = helper.make_node("Gemm", names, ["y"], **gemm)
    return make_model([node], inputs, [helper.make_tensor_value_info("y", T.FLOAT, out_shape)], inits)


def dynamic_quantize_matmul(model, a_shape: tuple):
    """onnxruntime's DynamicQuantizeMatMul on W's int8 codes per output channel (computed here with
    numpy, not with the pass), alpha folded into b_scale and beta * C as the bias, as the contract says."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    node = model.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    w = inits["w"].T if attrs.get("transB") else inits["w"]                     # [k, n]
    scale = np.abs(w).max(axis=0) / np.float32(127)
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    scale = (scale * np.float32(attrs.get("alpha", 1.0))).astype(np.float32)
    tensors = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scale, "scale")]
    names = ["x", "codes", "scale", ""]
    if "c" in inits:
        tensors.append(numpy_helper.from_array((inits["c"] * np.float32(attrs.get("beta", 1.0))).astype(np.float32), "c"))
        names.append("c")
    nodes = [helper.make_node("DynamicQuantizeMatMul", names, ["y"], domain="com.microsoft")]
    reference = make_model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, list(a_shape))],
                           list(model.graph.output), tensors)
    reference.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return reference


def variant_graph(model, integer_gemm: bool = True):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return narrowed(graph, "int8", integer_gemm)


@pytest.mark.parametrize("features", FEATURES, ids=["simd", "relaxed-simd"])
@pytest.mark.parametrize("a_shape,n,gemm,bias", [
    ((16, 64), 48, None, None), ((3, 37), 50, None, None), ((2, 8, 64), 40, None, None), ((2, 3, 5, 96), 33, None, None),
    ((16, 64), 48, {"transB": 1}, "const"), ((13, 130), 23, {"transB": 1}, "const"),
    ((8, 64), 48, {}, None), ((8, 64), 48, {"transB": 1, "alpha": 0.5, "beta": 2.0}, "const")],
    ids=["matmul-2d", "matmul-3-rows", "matmul-3d", "matmul-4d", "gemm-transB-bias", "gemm-edges", "gemm-plain",
         "gemm-alpha-beta"])
def test_a_gemm_shaped_product_runs_on_the_integer_kernel_as_dynamic_quantize_matmul(a_shape, n, gemm, bias,
                                                                                     features):
    model = product_model(a_shape, n, gemm=gemm, bias=bias, seed=sum(a_shape) + n)
    graph = variant_graph(model)
    assert [node.op_type for node in graph.nodes] == INTEGER_FORM + (["Add"] if bias else [])
    artifact = compiled(graph, features)
    # Cast, Mul and the bias are the kernel's epilogue; the scale's Mul is one vector of n.
    assert kernels(artifact) == ["DynamicQuantizeLinear", "Mul", "MatMulInteger"]
    assert "_integer_gemm" in artifact.wat, "the integer product ran as a loop nest"
    feeds = {"x": np.random.default_rng(n).standard_normal(a_shape).astype(np.float32)}
    got = run(artifact, features, feeds)
    want = run_onnxruntime(dynamic_quantize_matmul(model, a_shape), feeds)["y"]
    # Integer sums are exact; the scale and bias are rounded to float32 as onnxruntime rounds them.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = run_onnxruntime(model, feeds)["y"]
    # 8-bit activations (steps of range / 255) and weights (max|w| / 127): about 1% relative L2.
    assert 1e-4 < np.linalg.norm(got - exact) / np.linalg.norm(exact) < 3e-2


@pytest.mark.parametrize("a_shape,gemm", [((1, 64), None), ((2, 64), None), ((1, 2, 64), None), ((2, 64), {"transB": 1})])
def test_one_or_two_rows_keep_the_weight_only_form_the_gemv_reads(a_shape, gemm):
    graph = variant_graph(product_model(a_shape, 48, gemm=gemm, bias="const" if gemm else None))
    assert "DynamicQuantizeLinear" not in {node.op_type for node in graph.nodes}
    assert kernels(compiled(graph, "simd,bulk-memory")) == ["Gemm" if gemm else "MatMul"]


@pytest.mark.parametrize("a_shape,gemm,bias,integer", [
    ((64, 16), {"transA": 1, "transB": 1}, "const", False),      # A^T: left to the float GEMM's packing
    ((16, 64), {"beta": 0.5}, "input", False),                   # a run-time C scaled by beta
    ((16, 64), {"transB": 1}, "input", True)])                   # a run-time C added as it is
def test_gemm_forms_outside_the_contract_keep_the_weight_only_form(a_shape, gemm, bias, integer):
    model = product_model(a_shape, 48, gemm=gemm, bias=bias)
    graph = variant_graph(model)
    assert ("MatMulInteger" in {node.op_type for node in graph.nodes}) == integer
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal(a_shape).astype(np.float32)}
    if bias == "input":
        feeds["c"] = rng.standard_normal((16, 48)).astype(np.float32)
    got = run(compiled(graph, "simd,bulk-memory"), "simd,bulk-memory", feeds)
    exact = run_onnxruntime(model, feeds)["y"]
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 3e-2


def test_without_integer_gemm_every_product_keeps_the_weight_only_form():
    graph = variant_graph(product_model((16, 64), 48), integer_gemm=False)
    assert [node.op_type for node in graph.nodes] == ["Cast", "Mul", "MatMul"]
