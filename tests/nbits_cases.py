"""MatMulNBits models built by code, for the runtimes' tests (tests/test_js_nbits.py,
tests/test_nbits_memory.py): a model of three independent nodes (4-bit codes with zero points in
blocks of 32 and 8-bit codes in blocks of 16, K not a multiple of either; more than two rows of A,
which the wasm target runs on the GEMM's tiles, and one or two, which it runs on the block kernel)
at a given accuracy level, and one 4-bit product large enough that its CU's bytes are mostly
weights, with its float32 twin (the same weights dequantized, as a MatMul).

The codes are packed as onnxruntime stores them: [N, blocks, block * bits / 8] bytes of bit fields,
low bits first, zero points the same way with each column starting on a byte."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ir.ops.matmul_nbits import dequantized_blocks

DOMAIN = "com.microsoft"
# (input, output, bits, K, N, block, zero points, rows of A)
NODES = (("x4", "y4", 4, 80, 40, 32, True, (2, 3)), ("r4", "z4", 4, 80, 24, 32, True, (2,)),
         ("x8", "y8", 8, 40, 24, 16, False, (1,)))
# One product of 1 MiB of float32 weights: its 4-bit codes, scales and zero points are 0.16 of that.
LARGE_K, LARGE_N, LARGE_BLOCK = 1024, 256, 32


def packed_weight(rng: np.random.Generator, bits: int, k: int, n: int, block: int, zero_points: bool) -> dict:
    """Random codes B [N, blocks, blob], scales [N * blocks] and, if asked, packed zero points."""
    blocks = -(-k // block)
    weight = {"b": rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8),
              "s": (rng.random(n * blocks) * 0.1 + 0.01).astype(np.float32)}
    if zero_points:
        weight["zp"] = rng.integers(0, 256, n * -(-blocks * bits // 8), dtype=np.uint8)
    return weight


def dequantized(weight: dict, bits: int, k: int, n: int, block: int) -> np.ndarray:
    """B^T as float32 [K, N]: (code - zero point) * scale, rounded once, as onnxruntime's level 0 reads it."""
    return dequantized_blocks(weight["b"], weight["s"], weight.get("zp"), k, n, bits, block).T.copy()


def _model(nodes, inputs, outputs, initializers, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return model


def _nbits_node(x: str, y: str, bits: int, k: int, n: int, block: int, weight: dict, level: int):
    order = [x, f"{y}_b", f"{y}_s"] + ([f"{y}_zp"] if "zp" in weight else [])
    node = helper.make_node("MatMulNBits", order, [y], name=f"{y}_matmulnbits", domain=DOMAIN, K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=level)
    return node, [numpy_helper.from_array(array, f"{y}_{key}") for key, array in weight.items()]


def nbits_nodes(level: int, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """NODES at `accuracy_level` `level`, with one feed (the same codes and feed for every level)."""
    rng = np.random.default_rng(seed)
    nodes, initializers, inputs, outputs, feeds = [], [], [], [], {}
    for x, y, bits, k, n, block, zero_points, rows in NODES:
        node, weights = _nbits_node(x, y, bits, k, n, block, packed_weight(rng, bits, k, n, block, zero_points), level)
        nodes.append(node)
        initializers += weights
        feeds[x] = rng.standard_normal((*rows, k)).astype(np.float32)
        inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, [*rows, k]))
        outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, [*rows, n]))
    return _model(nodes, inputs, outputs, initializers, f"nbits_nodes_level_{level}"), feeds


def large_product(level: int = 4, seed: int = 1) -> tuple[onnx.ModelProto, onnx.ModelProto, dict[str, np.ndarray]]:
    """One 4-bit product of LARGE_K x LARGE_N with zero points, its float32 MatMul twin, and a feed of one row."""
    rng = np.random.default_rng(seed)
    weight = packed_weight(rng, 4, LARGE_K, LARGE_N, LARGE_BLOCK, True)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, LARGE_K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, LARGE_N])
    node, weights = _nbits_node("x", "y", 4, LARGE_K, LARGE_N, LARGE_BLOCK, weight, level)
    narrow = _model([node], [x], [y], weights, "large_nbits")
    twin = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y],
                  [numpy_helper.from_array(dequantized(weight, 4, LARGE_K, LARGE_N, LARGE_BLOCK), "w")], "large_float")
    return narrow, twin, {"x": rng.standard_normal((1, LARGE_K)).astype(np.float32)}
