"""The YOLO-style detector built by code (samples/detector.py) compiles to wasm and matches
onnxruntime: every box coordinate and class score within 1e-4 relative."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import cortex
from wasm_cases import compile_pipeline

pytestmark = pytest.mark.slow
RELAXED = ("simd,bulk-memory,relaxed-simd", "3")


@pytest.fixture(scope="module")
def detector():
    pytest.importorskip("torch")
    from samples.detector import detector
    return detector()


def test_detector_holds_the_yolo_blocks(detector):
    ops = {n.op_type for n in onnx.load(detector.path).graph.node}
    # Conv-BN-SiLU (BN folded at export), SPPF's pools, the neck's Upsample + Concat, the boxes' Softmax
    assert {"Conv", "Sigmoid", "Mul", "MaxPool", "Resize", "Concat", "Softmax", "Split"} <= ops
    assert detector.outputs["output0"].shape == (1, 84, 2100)


@pytest.mark.parametrize("partition", [{}, {"max_cu_depth": 1, "min_cu_size": 0}], ids=["default", "depth-1"])
def test_detector_matches_onnxruntime(detector, partition, tmp_path):
    features, level = RELAXED
    dag = compile_pipeline(detector.path, tmp_path, features, level, detector.input_shapes, **partition)
    got = cortex.load(dag, device="wasm", policy="strict").run(detector.inputs)["output0"]
    want = detector.outputs["output0"]
    boxes, scores = slice(0, 4), slice(4, None)   # pixels (up to the input's size) and probabilities
    np.testing.assert_allclose(got[:, boxes], want[:, boxes], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[:, scores], want[:, scores], rtol=1e-4, atol=1e-6)
