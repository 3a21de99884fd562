"""decompose --parallel N slices an attention block by heads: each slice runs its heads from the Q, K
and V projections to its rows of the output projection, the slices meeting once in a Sum; outputs
equal onnxruntime's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import helper, numpy_helper
from test_parallel_split import (
    EVERY_OP,
    assert_matches_onnxruntime,
    build,
    const,
    level_of,
    save,
)
from testdata import minilm

from backends.registry import target
from bench.thread_profile import critical_path, list_schedule
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from cortex.runtime import load
from ir.fs import write_bytes_atomically
from ir.options import from_text
from passes.partition import PartitionIntoCUs

SEQ, HEADS, HEAD_SIZE = 16, 4, 8
HIDDEN = HEADS * HEAD_SIZE


def attention(tmp_path, opset: int = 17, softmax: dict | None = None):
    """A BERT self-attention block as torch exports it, the mask a model input."""
    nodes, inits = [], [const("wo", HIDDEN, HIDDEN), const("bo", HIDDEN)]
    split = numpy_helper.from_array(np.array([1, SEQ, HEADS, HEAD_SIZE], np.int64), "split_shape")
    merge = numpy_helper.from_array(np.array([1, SEQ, HIDDEN], np.int64), "merge_shape")
    scale = numpy_helper.from_array(np.array(HEAD_SIZE ** -0.5, np.float32), "scale")
    inits += [split, merge, scale]
    for name, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        inits += [const(f"w{name}", HIDDEN, HIDDEN), const(f"b{name}", HIDDEN)]
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_mm"], name=f"{name}_proj"),
                  helper.make_node("Add", [f"b{name}", f"{name}_mm"], [f"{name}_b"], name=f"{name}_bias"),
                  helper.make_node("Reshape", [f"{name}_b", "split_shape"], [f"{name}_r"], name=f"{name}_split"),
                  helper.make_node("Transpose", [f"{name}_r"], [f"{name}_t"], name=f"{name}_heads", perm=perm)]
    nodes += [helper.make_node("MatMul", ["q_t", "k_t"], ["scores"], name="qk"),
              helper.make_node("Mul", ["scores", "scale"], ["scaled"], name="scale_scores"),
              helper.make_node("Add", ["scaled", "mask"], ["masked"], name="add_mask"),
              helper.make_node("Softmax", ["masked"], ["probs"], name="softmax", **({"axis": -1} if softmax is None else softmax)),
              helper.make_node("MatMul", ["probs", "v_t"], ["context"], name="av"),
              helper.make_node("Transpose", ["context"], ["context_t"], name="unheads", perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["context_t", "merge_shape"], ["merged"], name="merge"),
              helper.make_node("MatMul", ["merged", "wo"], ["o_mm"], name="out_proj"),
              helper.make_node("Add", ["bo", "o_mm"], ["o_b"], name="out_bias"),
              helper.make_node("Add", ["o_b", "x"], ["y"], name="residual")]
    path, feeds = save(tmp_path, nodes, [("x", [1, SEQ, HIDDEN]), ("mask", [1, 1, SEQ, SEQ])], ["y"], inits, opset)
    feeds["mask"] = np.where(np.arange(SEQ) < SEQ - 3, 0.0, -10000.0).astype(np.float32) * np.ones((1, 1, SEQ, 1),
                                                                                                  np.float32)
    return path, feeds


def test_attention_slices_by_heads_and_meets_once_in_a_sum(tmp_path):
    path, feeds = attention(tmp_path)
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    softmaxes = [cu["id"] for cu in dag["cus"] if "Softmax" in cu["op_types"]]
    assert len(softmaxes) == 2                        # two groups of two heads, each in its own CUs
    assert level_of(dag)[softmaxes[0]] == level_of(dag)[softmaxes[1]]
    assert not any("Concat" in cu["op_types"] for cu in dag["cus"])   # no projection meets alone
    (join,) = [cu for cu in dag["cus"] if "Sum" in cu["op_types"]]
    assert "Add" in join["op_types"]                  # output bias and residual, once, after the Sum
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_a_walk_in_dag_order_runs_the_head_slices_side_by_side(tmp_path):
    # The slices' CUs alternate in dag.json's order, so a schedule that starts them in that order on
    # two cores is as short as the longest chain (were one slice's chain listed whole before the
    # other's, that schedule would run the two one after the other).
    path, _ = attention(tmp_path)
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    unit = {cu["id"]: 1.0 for cu in dag["cus"]}
    assert list_schedule(dag, unit, 2) == critical_path(dag, unit) < len(unit)


def test_attention_in_four_slices_of_one_head_each(tmp_path):
    path, feeds = attention(tmp_path)
    _, dag = build(tmp_path, path, parallel=4, **EVERY_OP)
    softmaxes = [cu["id"] for cu in dag["cus"] if "Softmax" in cu["op_types"]]
    assert len(softmaxes) == 4 and len({level_of(dag)[cu] for cu in softmaxes}) == 1
    assert_matches_onnxruntime(tmp_path, path, feeds, threads=4)


def test_heads_that_do_not_divide_fall_back_to_slicing_the_projections(tmp_path):
    path, _ = attention(tmp_path)
    summary = decompose_model(path, tmp_path / "cus", PartitionIntoCUs(min_cu_size=0, parallel=3, **EVERY_OP))
    assert summary["sliced_ops"] == 4                 # q, k, v and out by output channels: 4 heads / 3
    assert not any("Sum" in cu["op_types"] for cu in json.loads((tmp_path / "cus" / "manifest.json").read_text())["cus"])


def test_a_softmax_over_the_heads_keeps_them_together(tmp_path):
    # Before opset 13 Softmax's default axis 1 normalizes over heads, rows and columns at once.
    path, feeds = attention(tmp_path, opset=11, softmax={})
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    assert len([cu for cu in dag["cus"] if "Softmax" in cu["op_types"]]) == 1
    assert not any("Sum" in cu["op_types"] for cu in dag["cus"])
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_an_opset_11_softmax_over_the_last_axis_slices_by_heads(tmp_path):
    path, feeds = attention(tmp_path, opset=11, softmax={"axis": 3})
    _, dag = build(tmp_path, path, parallel=2, **EVERY_OP)
    assert len([cu for cu in dag["cus"] if "Softmax" in cu["op_types"]]) == 2
    assert_matches_onnxruntime(tmp_path, path, feeds)


def test_parallel_one_keeps_the_attention_block_whole(tmp_path):
    path, _ = attention(tmp_path)
    whole = decompose_model(path, tmp_path / "a", PartitionIntoCUs(min_cu_size=0))
    one = decompose_model(path, tmp_path / "b", PartitionIntoCUs(min_cu_size=0, parallel=1, **EVERY_OP))
    assert one["cus"] == whole["cus"] and one["sliced_ops"] == 0
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()


@pytest.mark.slow
def test_minilm_sliced_by_heads_matches_onnxruntime(tmp_path):
    model = minilm(batch=1, seq=16)
    shapes = {name: list(value.shape) for name, value in model.inputs.items()}
    summary = decompose_model(model.path, tmp_path / "cus", PartitionIntoCUs(parallel=2), input_shapes=shapes)
    manifest = json.loads((tmp_path / "cus" / "manifest.json").read_text())
    softmaxes = [cu for cu in manifest["cus"] if "Softmax" in cu["op_types"]]
    assert len(softmaxes) == 2 * 6 and summary["sliced_ops"] >= 6          # six layers, two groups of heads
    dag = build_dag(tmp_path / "cus", tmp_path / "dag.json")
    write_bytes_atomically(tmp_path / "dag.json", json.dumps(dag).encode())
    compile_cu_dir(target("wasm"), tmp_path / "cus", tmp_path / "wasm-bin", from_text(target("wasm").options),
                   tmp_path / "dag.json", jobs=1)
    got = load(tmp_path / "dag.json", threads=2, policy="strict").run(model.inputs)
    np.testing.assert_allclose(got["last_hidden_state"], model.outputs["last_hidden_state"], rtol=1e-4, atol=1e-4)
