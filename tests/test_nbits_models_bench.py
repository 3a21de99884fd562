"""bench/nbits_models.py's accounting on a two-layer MLP that onnxruntime's MatMulNBitsQuantizer
makes 4-bit: the float32 bytes the MatMulNBits nodes stand for, the CUs' weight bytes as dag.json
records them (the same bytes as the weight files of an --external-weights build), and Cortex's
outputs against onnxruntime's on the 4-bit file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench import cortex_side
from bench.nbits_models import agreement, cu_bytes, replaced_float_bytes
from cli_helpers import run_cli

K, HIDDEN, N, ROWS = 128, 256, 64, 8
FLOAT_WEIGHT_BYTES = 4 * (K * HIDDEN + HIDDEN * N)


def mlp(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((K, HIDDEN)) * 0.1).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((HIDDEN, N)) * 0.1).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, N])], [w1, w2])
    path = folder / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def quantized(source: Path) -> Path:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=4, block_size=32, is_symmetric=True)
    quantizer.process()
    path = source.with_name("mlp-int4.onnx")
    onnx.save(quantizer.model.model, path)
    return path


def built(model: Path, feed: dict, folder: Path):
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    reference = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    return cortex_side.build(model, {}, {}, feed, reference, folder, rtol=1e-4, atol=1e-4), reference


@pytest.mark.slow
def test_nbits_accounting_on_a_quantized_mlp(tmp_path):
    source = mlp(tmp_path)
    nbits = quantized(source)
    assert replaced_float_bytes(nbits) == FLOAT_WEIGHT_BYTES
    assert replaced_float_bytes(source) == 0

    feed = {"x": np.random.default_rng(1).standard_normal((ROWS, K)).astype(np.float32)}
    float_build, _ = built(source, feed, tmp_path / "float")
    nbits_build, reference = built(nbits, feed, tmp_path / "int4")
    float_bytes, nbits_bytes = cu_bytes(tmp_path / "float" / "dag.json"), cu_bytes(tmp_path / "int4" / "dag.json")
    assert float_bytes["weights"] >= FLOAT_WEIGHT_BYTES        # every weight held, float32 at least
    assert float_bytes["modules"] > float_bytes["weights"]     # embedded weights plus code
    assert nbits_bytes["weights"] < float_bytes["weights"]

    # The memory plans' weight bytes are what an --external-weights build writes as files.
    dag_path = tmp_path / "int4" / "dag.json"
    code, _, err = run_cli(["compile-wasm", "--cu-dir", tmp_path / "int4" / "cus", "--output",
                            tmp_path / "int4" / "external", "--dag", dag_path, "--external-weights"])
    assert code == 0, err
    records = [w for cu in json.loads(dag_path.read_text())["cus"] for w in cu["artifacts"]["wasm"].get("weights", ())]
    assert records and sum(w["bytes"] for w in records) == nbits_bytes["weights"] == cu_bytes(dag_path)["weights"]
    assert sum((dag_path.parent / w["path"]).stat().st_size for w in records) == nbits_bytes["weights"]

    got = agreement(nbits_build.loaded.run(feed), reference)
    assert got["cosine"] > 0.99999 and got["max_abs"] < 1e-4
