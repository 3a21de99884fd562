"""Block-quantized QDQ weights stay narrow: DequantizeLinear(4- or 8-bit codes, blocks along K, per
column or per tensor) -> MatMul becomes one MatMulNBits (passes/dq_matmul_nbits.py, a rule of
fold-qdq), computes what onnxruntime computes on the QDQ model, and its CU holds the narrow bytes.

The reference is onnxruntime's plain kernels (testdata.run_onnxruntime: graph optimisations off),
the float32 product of the dequantized weight. With its optimisations on, onnxruntime fuses the
same pattern into MatMulNBits at accuracy level 4 by default (session config
`session.qdq_matmulnbits_accuracy_level`), which quantizes A to int8: a different arithmetic, so
one test sets that level to 0 and checks the fused kernel agrees too."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantFormat
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

import cortex
from cli_helpers import build_and_run
from testdata import run_onnxruntime
from wasm_cases import compile_pipeline

RNG = np.random.default_rng(21)
ROWS = 3


def _float_model(k: int, n: int, weight: np.ndarray | None = None) -> onnx.ModelProto:
    """x [ROWS, K] @ w [K, N] at opset 21."""
    weight = RNG.standard_normal((k, n)).astype(np.float32) if weight is None else weight
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")], "qdq_blocks",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, n])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _quantizer_model(k: int, n: int, block: int, symmetric: bool) -> onnx.ModelProto:
    """onnxruntime's 4-bit weight-only quantizer writing the QDQ form."""
    quantizer = MatMulNBitsQuantizer(_float_model(k, n), block_size=block, is_symmetric=symmetric,
                                     quant_format=QuantFormat.QDQ)
    quantizer.process()
    model = quantizer.model.model
    assert [node.op_type for node in model.graph.node] == ["DequantizeLinear", "MatMul"]
    return model


def _dq_matmul_model(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, **dq_attrs) -> onnx.ModelProto:
    """x @ DequantizeLinear(codes, scale[, zero]) with the codes' own element type (int4 included)."""
    k, n = codes.shape
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scale, "scale")]
    if zero is not None:
        inits.append(numpy_helper.from_array(zero, "zero"))
    nodes = [helper.make_node("DequantizeLinear", [i.name for i in inits], ["w"], name="dq", **dq_attrs),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")]
    graph = helper.make_graph(nodes, "dq_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _codes(dtype, shape) -> np.ndarray:
    info = ml_dtypes.iinfo(dtype) if dtype in (ml_dtypes.int4, ml_dtypes.uint4) else np.iinfo(dtype)
    return RNG.integers(int(info.min), int(info.max) + 1, shape).astype(dtype)


def _scales(shape) -> np.ndarray:
    return (RNG.random(shape) * 0.05 + 0.01).astype(np.float32)


def _feeds(model: onnx.ModelProto) -> dict:
    k = model.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    return {"x": RNG.standard_normal((ROWS, k)).astype(np.float32)}


def _compile(model: onnx.ModelProto, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    return compile_pipeline(folder / "model.onnx", folder, min_cu_size=1)


def _cu_ops(folder: Path) -> list[str]:
    return [node.op_type for cu in sorted((folder / "cus").glob("cu-*/cu.onnx")) for node in onnx.load(cu).graph.node]


def _weight_bytes(dag: Path) -> int:
    return sum(cu["artifacts"]["wasm"]["memory"]["weights_bytes"] for cu in json.loads(dag.read_text())["cus"])


def _assert_matches(got: np.ndarray, want: np.ndarray, x: np.ndarray, weight: np.ndarray) -> None:
    """Within float32 rounding of the sums: the kernel applies each block's scale and zero point to
    the block's sum, onnxruntime to each weight, and the two orders differ by a few epsilons of
    sum_k |x w|."""
    bound = np.abs(x) @ np.abs(weight)
    assert np.all(np.abs(got - want) <= 2e-6 * bound + 1e-7), np.max(np.abs(got - want) / (bound + 1e-6))


def _dequantized(model: onnx.ModelProto) -> np.ndarray:
    """The QDQ model's weight in float32, as onnxruntime's DequantizeLinear computes it."""
    probe = onnx.load_from_string(model.SerializeToString())
    probe.graph.ClearField("output")
    probe.graph.output.append(helper.make_empty_tensor_value_info(probe.graph.node[0].output[0]))
    probe.graph.ClearField("input")
    del probe.graph.node[1:]
    return run_onnxruntime(probe, {})[probe.graph.node[0].output[0]]


def _check(model: onnx.ModelProto, folder: Path) -> Path:
    """Compile `model`, assert its one product is a MatMulNBits that matches onnxruntime; the dag."""
    feeds = _feeds(model)
    dag = _compile(model, folder)
    assert _cu_ops(folder) == ["MatMulNBits"]
    got = cortex.load(dag, device="wasm").run(feeds)["y"]
    _assert_matches(got, run_onnxruntime(model, feeds)["y"], feeds["x"], _dequantized(model))
    return dag


# (K, N, block, symmetric): blocks of 32 and 128, K a multiple of the block or not
QUANTIZER_CASES = {
    "symmetric-block-32": (256, 40, 32, True),
    "zero-points-block-32-k-not-a-multiple": (100, 24, 32, False),
    "symmetric-block-128-k-not-a-multiple": (300, 17, 128, True),
    "zero-points-block-128": (256, 48, 128, False),
}


@pytest.mark.parametrize("case", QUANTIZER_CASES, ids=str)
def test_the_quantizers_qdq_weights_become_matmul_nbits(case, tmp_path):
    k, n, block, symmetric = QUANTIZER_CASES[case]
    _check(_quantizer_model(k, n, block, symmetric), tmp_path)


# (codes' type, K, N, block, zero points)
HAND_BUILT_CASES = {
    "int4-block-16-symmetric": (ml_dtypes.int4, 64, 20, 16, False),
    "int4-block-64-zero-points-k-not-a-multiple": (ml_dtypes.int4, 150, 16, 64, True),
    "uint4-block-16-zero-points": (ml_dtypes.uint4, 48, 33, 16, True),
    "int8-block-32-zero-points": (np.int8, 96, 16, 32, True),
    "uint8-block-64": (np.uint8, 128, 8, 64, False),
}


@pytest.mark.parametrize("case", HAND_BUILT_CASES, ids=str)
def test_dequantize_linear_in_blocks_becomes_matmul_nbits(case, tmp_path):
    dtype, k, n, block, zero_points = HAND_BUILT_CASES[case]
    blocks = -(-k // block)
    zero = _codes(dtype, (blocks, n)) if zero_points else None
    _check(_dq_matmul_model(_codes(dtype, (k, n)), _scales((blocks, n)), zero, axis=0, block_size=block), tmp_path)


# (codes' type, K, N, per column): one block of K rounded up to a power of two, or blocks of 128
PER_AXIS_CASES = {
    "int8-per-column-k-100": (np.int8, 100, 24, True),
    "uint8-per-column-k-384": (np.uint8, 384, 16, True),
    "int8-per-tensor-k-48": (np.int8, 48, 32, False),
}


@pytest.mark.parametrize("case", PER_AXIS_CASES, ids=str)
def test_a_per_column_or_per_tensor_weight_becomes_matmul_nbits(case, tmp_path):
    dtype, k, n, per_column = PER_AXIS_CASES[case]
    shape = (n,) if per_column else ()
    _check(_dq_matmul_model(_codes(dtype, (k, n)), _scales(shape), _codes(dtype, shape), axis=1), tmp_path)


def test_the_4_bit_weight_holds_a_fifth_of_its_float32_bytes(tmp_path):
    """Built with the installed CLI; the CU's weight bytes against the same weight dequantized."""
    model = _quantizer_model(512, 256, 32, symmetric=False)
    feeds = _feeds(model)
    onnx.save(model, tmp_path / "qdq.onnx")
    (tmp_path / "qdq").mkdir()
    got = build_and_run(tmp_path / "qdq.onnx", tmp_path / "qdq", feeds)["y"]
    weight = _dequantized(model)
    _assert_matches(got, run_onnxruntime(model, feeds)["y"], feeds["x"], weight)
    dequantized = _compile(_float_model(512, 256, weight), tmp_path / "float")
    assert _cu_ops(tmp_path / "float") == ["MatMul"]
    ratio = _weight_bytes(tmp_path / "qdq" / "dag.json") / _weight_bytes(dequantized)
    assert ratio <= 0.2, ratio


def test_a_weight_shared_by_two_matmuls_becomes_two_matmul_nbits(tmp_path):
    k, n, block = 64, 16, 32
    model = _dq_matmul_model(_codes(ml_dtypes.int4, (k, n)), _scales((k // block, n)), None, axis=0, block_size=block)
    model.graph.node.append(helper.make_node("MatMul", ["x2", "w"], ["y2"], name="matmul2"))
    model.graph.input.append(helper.make_tensor_value_info("x2", TensorProto.FLOAT, [ROWS, k]))
    model.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [ROWS, n]))
    feeds = {**_feeds(model), "x2": RNG.standard_normal((ROWS, k)).astype(np.float32)}
    dag = _compile(model, tmp_path)
    assert sorted(_cu_ops(tmp_path)) == ["MatMulNBits", "MatMulNBits"]
    got, want = cortex.load(dag, device="wasm").run(feeds), run_onnxruntime(model, feeds)
    weight = _dequantized(model)
    for x, y in (("x", "y"), ("x2", "y2")):
        _assert_matches(got[y], want[y], feeds[x], weight)


# Forms MatMulNBits cannot hold, or that would hold the weight twice: folded to float32 as before.
def _block_of_24() -> onnx.ModelProto:
    return _dq_matmul_model(_codes(ml_dtypes.int4, (48, 8)), _scales((2, 8)), None, axis=0, block_size=24)


def _blocks_along_n() -> onnx.ModelProto:
    return _dq_matmul_model(_codes(np.int8, (32, 32)), _scales((32, 2)), None, axis=1, block_size=16)


def _also_read_as_float() -> onnx.ModelProto:
    model = _dq_matmul_model(_codes(ml_dtypes.int4, (32, 32)), _scales((2, 32)), None, axis=0, block_size=16)
    model.graph.node.append(helper.make_node("Add", ["y", "w"], ["sum"], name="add"))   # [3, 32] + [32, 32]
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("sum", TensorProto.FLOAT, [32, 32]))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 32]))
    return model


LEFT_AS_FLOAT = {"block-of-24": _block_of_24, "blocks-along-n": _blocks_along_n,
                 "weight-also-read-as-float": _also_read_as_float}


@pytest.mark.parametrize("case", LEFT_AS_FLOAT, ids=str)
def test_forms_matmul_nbits_cannot_hold_fold_to_float32(case, tmp_path):
    model = LEFT_AS_FLOAT[case]()
    feeds = {"x": RNG.standard_normal(tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim))
             .astype(np.float32)}
    dag = _compile(model, tmp_path)
    assert "MatMul" in _cu_ops(tmp_path) and "MatMulNBits" not in _cu_ops(tmp_path)
    output = model.graph.output[0].name
    want = run_onnxruntime(model, feeds)[output]
    np.testing.assert_allclose(cortex.load(dag, device="wasm").run(feeds)[output], want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


def test_onnxruntimes_own_fusion_at_accuracy_level_0_agrees(tmp_path):
    """onnxruntime, optimising, turns the same QDQ model into its MatMulNBits; at accuracy level 0
    that kernel computes what the narrow CU computes."""
    model = _quantizer_model(256, 48, 32, symmetric=False)
    feeds = _feeds(model)
    dag = _compile(model, tmp_path)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    fused = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    _assert_matches(cortex.load(dag, device="wasm").run(feeds)["y"], fused.run(None, feeds)[0], feeds["x"],
                    _dequantized(model))
