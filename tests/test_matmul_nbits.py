"""MatMulNBits kept narrow (ir/ops/matmul_nbits.py): each accuracy level computes what onnxruntime
computes on the same node, a split node's pieces still do, and the CU holds the 4-bit bytes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cortex
from ir.ops.matmul_nbits import dequantized_blocks
from test_contrib_quantized import nbits_case, node_model, run_onnxruntime, run_on_wasm
from wasm_cases import compile_pipeline

RNG = np.random.default_rng(11)

# (bits, K, N, block, zero points, rows): block sizes 16 to 128, K a multiple of the block or not
LEVEL_4_CASES = {
    "4-bit-block-16": (4, 64, 24, 16, None, (3,)),
    "4-bit-block-32-zero-points-k-not-a-multiple": (4, 80, 8, 32, "packed", (2, 3)),
    "4-bit-block-64-zero-points": (4, 192, 40, 64, "packed", (1,)),
    "4-bit-block-128-k-not-a-multiple": (4, 300, 17, 128, None, (2,)),
    "8-bit-block-16-zero-points": (8, 48, 8, 16, "packed", (3,)),
    "8-bit-block-32": (8, 96, 33, 32, None, (1,)),
    "4-bit-block-16-k-odd-rows-5": (4, 101, 19, 16, "packed", (5,)),
    "8-bit-block-64-k-odd-rows-3": (8, 131, 16, 64, None, (3,)),
}


def _level(attrs: dict, level: int) -> dict:
    return {**attrs, "accuracy_level": level}


@pytest.mark.parametrize("case", LEVEL_4_CASES, ids=str)
def test_accuracy_level_4_quantizes_a_per_block_as_onnxruntime_does(case, tmp_path):
    bits, k, n, block, zero_points, rows = LEVEL_4_CASES[case]
    feeds, constants, order, attrs = nbits_case(bits, k, n, block, zero_points, rows=rows)
    level_4 = node_model("MatMulNBits", feeds, constants, order, **_level(attrs, 4))
    want = run_onnxruntime(level_4, feeds)["out"]
    float_a = run_onnxruntime(node_model("MatMulNBits", feeds, constants, order, **_level(attrs, 0)), feeds)["out"]
    got = run_on_wasm(level_4, feeds, tmp_path)["out"]
    # int8 A moves the result by far more than float32 rounding: the test tells the two apart
    quantization = np.abs(want - float_a).max()
    assert quantization > 1e-3 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max() + 1e-6)
    assert np.abs(got - want).max() < 0.01 * quantization


@pytest.mark.parametrize("level", [0, 1, 4])
def test_a_zero_row_and_a_row_with_one_large_value(level, tmp_path):
    """A block of A all zeros (scale 0: onnxruntime's inverse scale is 0, no division by zero) and
    one dominated by one value (every other code rounds to 0 or +-1)."""
    feeds, constants, order, attrs = nbits_case(4, 64, 16, 32, "packed", rows=(3,))
    feeds["a"][0] = 0.0
    feeds["a"][1, 5] = 1000.0
    model = node_model("MatMulNBits", feeds, constants, order, **_level(attrs, level))
    want = run_onnxruntime(model, feeds)["out"]
    got = run_on_wasm(model, feeds, tmp_path)["out"]
    np.testing.assert_array_equal(got[0], np.zeros_like(got[0]))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def _chain_model(k: int, n: int, block: int, level: int) -> tuple[onnx.ModelProto, dict]:
    """x -> MatMulNBits -> Relu -> MatMulNBits: two weights of N x K 4-bit codes with zero points."""
    nodes, inits = [], []
    for i, (rows, cols) in enumerate(((k, n), (n, k))):
        blocks = -(-rows // block)
        inits += [numpy_helper.from_array(RNG.integers(0, 256, (cols, blocks, block // 2), dtype=np.uint8), f"b{i}"),
                  numpy_helper.from_array((RNG.random(cols * blocks) * 0.02 + 0.005).astype(np.float32), f"s{i}"),
                  numpy_helper.from_array(RNG.integers(0, 256, cols * -(-blocks // 2), dtype=np.uint8), f"z{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["x" if i == 0 else "h", f"b{i}", f"s{i}", f"z{i}"],
                                      ["m" if i == 0 else "y"], domain="com.microsoft", K=rows, N=cols, bits=4,
                                      block_size=block, accuracy_level=level))
        if i == 0:
            nodes.append(helper.make_node("Relu", ["m"], ["h"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, k])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model, {"x": RNG.standard_normal((2, k)).astype(np.float32)}


@pytest.mark.parametrize("level", [0, 4])
def test_a_node_over_the_cu_size_splits_along_its_columns(level, tmp_path):
    model, feeds = _chain_model(256, 160, 32, level)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    dag = compile_pipeline(path, tmp_path, min_cu_size=1, max_cu_size=8_000)
    assert len(json.loads(dag.read_text())["cus"]) >= 4   # each weight holds 20,480 bytes of codes: both split
    got = cortex.load(dag, device="wasm").run(feeds)["y"]
    want = run_onnxruntime(model, feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def _artifact_bytes(folder) -> int:
    return sum(f.stat().st_size for f in (folder / "wasm-bin").rglob("*") if f.is_file())


def test_a_4_bit_weight_keeps_its_bytes_in_the_cu(tmp_path):
    """The CU of a 4-bit MatMulNBits holds at most 0.2x the bytes of the same product's float32 CU."""
    k, n, block = 1024, 256, 32
    feeds, constants, order, attrs = nbits_case(4, k, n, block, "packed", rows=(1,))
    narrow = node_model("MatMulNBits", feeds, constants, order, **attrs)
    want = run_onnxruntime(narrow, feeds)["out"]
    (tmp_path / "narrow").mkdir()
    got = run_on_wasm(narrow, feeds, tmp_path / "narrow")["out"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())   # sums of 1024 products
    # the same weights dequantized, as a float32 MatMul
    dequantized = onnx.load_from_string(narrow.SerializeToString())
    weight = dequantized_blocks(constants["b"], constants["s"], constants["zp"], k, n, 4, block).T.copy()
    dequantized.graph.ClearField("node")
    dequantized.graph.ClearField("initializer")
    dequantized.graph.initializer.append(numpy_helper.from_array(weight, "w"))
    dequantized.graph.node.append(helper.make_node("MatMul", ["a", "w"], ["out"]))
    (tmp_path / "float").mkdir()
    run_on_wasm(dequantized, feeds, tmp_path / "float")
    ratio = _artifact_bytes(tmp_path / "narrow") / _artifact_bytes(tmp_path / "float")
    assert ratio <= 0.2, ratio
