"""GatherBlockQuantized (com.microsoft), the embedding onnxruntime-genai's builder writes for a model
whose embedding and output projection share their 4-bit table, expanded into standard ops, matches
onnxruntime's kernel through decompose -> build-dag -> compile-wasm -> cortex.load: with and without
zero points, float32 scales, token ids of rank 1 and 2; forms the expansion does not take are
refused in one line naming the node."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cortex
from cli_helpers import assert_one_line_error, run_cli
from testdata import run_onnxruntime
from wasm_cases import compile_pipeline

RNG = np.random.default_rng(11)
VOCAB, WIDTH, BLOCK = 40, 64, 16


def gather_model(ids_shape, zero_points: bool, bits: int = 4, gather_axis: int = 0) -> onnx.ModelProto:
    table = numpy_helper.from_array(RNG.integers(0, 256, (VOCAB, WIDTH // 2), dtype=np.uint8), "table")
    scales = numpy_helper.from_array(RNG.uniform(0.01, 0.1, (VOCAB, WIDTH // BLOCK)).astype(np.float32), "scales")
    constants = [table, scales]
    order = ["table", "ids", "scales"]
    if zero_points:
        constants.append(numpy_helper.from_array(RNG.integers(0, 256, (VOCAB, WIDTH // BLOCK // 2), dtype=np.uint8),
                                                 "zeros"))
        order.append("zeros")
    node = helper.make_node("GatherBlockQuantized", order, ["embedded"], name="embed", domain="com.microsoft",
                            bits=bits, block_size=BLOCK, gather_axis=gather_axis, quantize_axis=1)
    graph = helper.make_graph([node], "embed", [helper.make_tensor_value_info("ids", TensorProto.INT64, ids_shape)],
                              [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, None)], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("ids_shape", [(5,), (1, 7)])
@pytest.mark.parametrize("zero_points", [False, True])
def test_gathered_rows_match_onnxruntime(tmp_path, ids_shape, zero_points):
    model = gather_model(ids_shape, zero_points)
    feeds = {"ids": RNG.integers(0, VOCAB, ids_shape).astype(np.int64)}
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    dag = compile_pipeline(path, tmp_path, min_cu_size=1)
    got = cortex.load(dag, device="wasm").run(feeds)["embedded"]
    want = run_onnxruntime(model, feeds)["embedded"]
    assert got.shape == (*ids_shape, WIDTH)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # the table stays 4-bit: the CUs hold less than its dequantized float32 copy would
    weights = sum(cu["artifacts"]["wasm"]["memory"]["weights_bytes"] for cu in json.loads(dag.read_text())["cus"])
    assert weights < VOCAB * WIDTH * 4


def test_other_forms_are_refused_naming_the_node(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(gather_model((3,), False, gather_axis=1), path)
    code, _, err = run_cli(["build", str(path), "--output", str(tmp_path / "out"), "--no-cache"])
    assert_one_line_error(code, err, "embed", "gathered along axis 0")
