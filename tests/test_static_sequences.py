"""Sequence values whose elements are known at compile time (passes/static_sequences.py): what
TorchScript exports of list code write (a list built and concatenated, `torch.split` into a list
read by position, a loop appending to a list) compiles to tensor ops and matches onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from cli_helpers import build_and_run
from ir.onnx_import import import_model
from passes import InferShapes
from testdata import run_onnxruntime

RNG = np.random.default_rng(3)
vi = helper.make_tensor_value_info


def const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "sequences", inputs, outputs, list(initializers))
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    built.ir_version = 8
    return built


def construct_and_concat(opset):
    nodes = [helper.make_node("Relu", ["a"], ["ra"]), helper.make_node("SequenceConstruct", ["ra", "b"], ["s"]),
             helper.make_node("SequenceInsert", ["s", "a", "front"], ["s2"]),
             helper.make_node("SequenceErase", ["s2"], ["s3"]),                   # drops b again
             helper.make_node("ConcatFromSequence", ["s2"], ["y"], axis=1),
             helper.make_node("ConcatFromSequence", ["s3"], ["z"], axis=0, new_axis=1)]
    return model(nodes, [vi("a", T.FLOAT, [2, 3]), vi("b", T.FLOAT, [2, 3])],
                 [vi("y", T.FLOAT, None), vi("z", T.FLOAT, None)], [const("front", np.int64(0))], opset)


def split_and_read(opset):
    nodes = [helper.make_node("SplitToSequence", ["a", "sizes"], ["s"], axis=1),
             helper.make_node("SequenceAt", ["s", "last"], ["y"]), helper.make_node("SequenceLength", ["s"], ["n"]),
             helper.make_node("SplitToSequence", ["a"], ["rows"], axis=0, keepdims=0),
             helper.make_node("SequenceAt", ["rows", "one"], ["w"])]
    return model(nodes, [vi("a", T.FLOAT, [2, 3])], [vi("y", T.FLOAT, None), vi("n", T.INT64, None), vi("w", T.FLOAT, None)],
                 [const("sizes", np.array([1, 2], np.int64)), const("last", np.int64(-1)), const("one", np.int64(1))], opset)


def loop_appending(opset):
    """for i in range(3): outs.append(x * i); torch.stack(outs, 1), len(outs)"""
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["fi"], to=T.FLOAT), helper.make_node("Mul", ["a", "fi"], ["xi"]),
         helper.make_node("SequenceInsert", ["s_in", "xi"], ["s_out"]), helper.make_node("Identity", ["c"], ["c_out"])],
        "body", [vi("i", T.INT64, []), vi("c", T.BOOL, []), helper.make_tensor_sequence_value_info("s_in", T.FLOAT, None)],
        [vi("c_out", T.BOOL, []), helper.make_tensor_sequence_value_info("s_out", T.FLOAT, None)])
    nodes = [helper.make_node("SequenceEmpty", [], ["s0"], dtype=T.FLOAT),
             helper.make_node("Loop", ["trips", "true", "s0"], ["s"], body=body),
             helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=1, new_axis=1),
             helper.make_node("SequenceLength", ["s"], ["n"])]
    return model(nodes, [vi("a", T.FLOAT, [2, 3])], [vi("y", T.FLOAT, None), vi("n", T.INT64, None)],
                 [const("trips", np.int64(3)), const("true", np.array(True))], max(opset, 13))  # Loop-13 carries sequences


@pytest.mark.parametrize("opset", [12, 17])
@pytest.mark.parametrize("build", [construct_and_concat, split_and_read, loop_appending], ids=lambda f: f.__name__)
def test_static_sequences_compile_and_match_onnxruntime(build, opset, tmp_path):
    built = build(opset)
    onnx.save(built, tmp_path / "model.onnx")
    feeds = {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in built.graph.input}
    got, want = build_and_run(tmp_path / "model.onnx", tmp_path, feeds), run_onnxruntime(built, feeds)
    assert sorted(got) == sorted(want)
    for name, expected in want.items():
        assert got[name].shape == expected.shape and got[name].dtype == expected.dtype, name
        np.testing.assert_allclose(got[name], expected, rtol=1e-6, err_msg=name)


def test_a_sequence_read_by_an_op_with_no_static_elements_stays_a_sequence():
    """A position given at run time: the SequenceAt stays (a compile then names it), reading the
    SequenceConstruct of the split's parts."""
    nodes = [helper.make_node("SplitToSequence", ["a"], ["s"], axis=0, keepdims=0),
             helper.make_node("SequenceAt", ["s", "k"], ["y"])]
    built = model(nodes, [vi("a", T.FLOAT, [2, 3]), vi("k", T.INT64, [])], [vi("y", T.FLOAT, [3])])
    graph = InferShapes().run(import_model(built))
    assert [n.op_type for n in graph.nodes] == ["Split", "Squeeze", "Squeeze", "SequenceConstruct", "SequenceAt"]
