"""An If whose branch is chosen by a model input, as a voice-activity model picks its 8 kHz or
16 kHz branch from a scalar `sr`: with branches of different shapes the error names the deciding
input and the flag that specialises it; with `--freeze-input` the taken branch is inlined and the
model compiles and matches onnxruntime; with small branches of one shape the If stays as it is."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import assert_one_line_error, run_cli
from testdata import run_onnxruntime


def vad_model(then_width: int, else_width: int) -> onnx.ModelProto:
    def branch(name, width, seed):
        w = numpy_helper.from_array(np.random.default_rng(seed).standard_normal((64, width)).astype(np.float32),
                                    f"{name}_w")
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [1, width])
        return helper.make_graph([helper.make_node("MatMul", ["x", f"{name}_w"], [f"{name}_out"])], name, [], [out], [w])
    nodes = [helper.make_node("Equal", ["sr", "k16000"], ["is_16k"]),
             helper.make_node("If", ["is_16k"], ["h"], name="pick_rate", then_branch=branch("wide", then_width, 1),
                              else_branch=branch("narrow", else_width, 2)),
             helper.make_node("Relu", ["h"], ["y"])]
    graph = helper.make_graph(
        nodes, "vad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
                       helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(16000, np.int64), "k16000")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def files(tmp_path):
    onnx.save(vad_model(512, 256), tmp_path / "vad.onnx")
    onnx.save(vad_model(256, 256), tmp_path / "same.onnx")
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    for rate in (8000, 16000):
        np.save(tmp_path / f"sr{rate}.npy", np.array(rate, np.int64))
    return tmp_path, x


def test_the_error_names_the_deciding_input_and_the_flag(files):
    folder, _ = files
    code, _, err = run_cli(["decompose", "--model-path", folder / "vad.onnx", "--output-dir", folder / "cus"])
    assert_one_line_error(code, err, "pick_rate", "model input 'sr'", "--freeze-input sr=")
    assert not (folder / "cus").exists()


@pytest.mark.parametrize("rate, width", [(16000, 512), (8000, 256)])
def test_a_frozen_condition_inlines_the_taken_branch(files, rate, width):
    folder, x = files
    out = folder / f"out{rate}"
    sr = folder / f"sr{rate}.npy"
    for argv in (["decompose", "--model-path", folder / "vad.onnx", "--output-dir", out / "cus", "--freeze-input",
                  f"sr={sr}"],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 ["compile-wasm", "--cu-dir", out / "cus", "--dag", out / "dag.json", "--output", out / "wasm"],
                 ["run", out / "dag.json", "--input", f"x={folder / 'x.npy'}", "--output", out / "y.npz"],
                 ["verify", out / "dag.json", "--model", folder / "vad.onnx", "--input", f"x={folder / 'x.npy'}",
                  "--input", f"sr={sr}"]):
        code, _, err = run_cli(argv)
        assert code == 0, (argv[0], err)
    y = np.load(out / "y.npz")["y"]
    expected = run_onnxruntime(folder / "vad.onnx", {"x": x, "sr": np.array(rate, np.int64)})["y"]
    assert y.shape == (1, width)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    cu = onnx.load(out / "cus" / "cu-0000" / "cu.onnx")
    assert "If" not in {n.op_type for n in cu.graph.node}
    other = folder / f"sr{24000 - rate}.npy"
    code, _, err = run_cli(["verify", out / "dag.json", "--model", folder / "vad.onnx", "--input",
                            f"x={folder / 'x.npy'}", "--input", f"sr={other}"])
    assert_one_line_error(code, err, "not the value frozen")


def test_small_branches_of_one_shape_keep_the_if(files):
    folder, _ = files
    # Each branch holds 16,384 parameters: under this --min-cu-size the If is one op of one CU
    # (above it, it becomes branch CUs: tests/test_conditional_cus.py).
    code, _, err = run_cli(["decompose", "--model-path", folder / "same.onnx", "--output-dir", folder / "cus",
                            "--min-cu-size", "20000"])
    assert code == 0, err
    ops = {n.op_type for p in (folder / "cus").glob("cu-*/cu.onnx") for n in onnx.load(p).graph.node}
    assert "If" in ops
