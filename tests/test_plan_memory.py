"""The memory planner: live buffers never overlap, offsets are aligned, and real models come close
to the lower bound."""

from __future__ import annotations

import json

import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from ir.errors import CortexError
from ir.onnx_import import load_model
from passes import InferShapes, optimize_pipeline, run_pipeline
from passes.plan_memory import (Lifetime, PlanMemory, lifetimes_for_schedule, plan_dag_memory, plan_graph_memory,
                                plan_memory)
from tests.testdata import LIGHT_MODEL_NAMES, light_model


@st.composite
def buffer_lists(draw):
    count = draw(st.integers(0, 30))
    steps = draw(st.integers(1, 20))
    buffers = []
    for i in range(count):
        first = draw(st.integers(0, steps - 1))
        last = draw(st.integers(first, steps - 1))
        alias = None
        if buffers and draw(st.booleans()):
            alias = draw(st.sampled_from(buffers)).name  # often illegal: the planner must check
        buffers.append(Lifetime(f"t{i}", draw(st.integers(0, 5000)), first, last,
                              draw(st.sampled_from([1, 4, 16, 64])), alias))
    return buffers


def _overlaps(a: Lifetime, b: Lifetime, plan) -> bool:
    oa, ob = plan.offsets[a.name], plan.offsets[b.name]
    return a.size > 0 and b.size > 0 and oa < ob + b.size and ob < oa + a.size


def _handover(a: Lifetime, b: Lifetime, plan) -> bool:
    """b writes over a in place, at the step where a dies and b is born."""
    return plan.aliases.get(b.name) == a.name and a.last_use == b.first_use


@settings(max_examples=300, deadline=None)
@given(buffer_lists())
def test_no_two_simultaneously_live_buffers_overlap(buffers):
    plan = plan_memory(buffers)
    for i, a in enumerate(buffers):
        for b in buffers[i + 1:]:
            live_together = a.first_use <= b.last_use and b.first_use <= a.last_use
            if live_together and _overlaps(a, b, plan):
                assert _handover(a, b, plan) or _handover(b, a, plan), (a, b, plan)


@settings(max_examples=300, deadline=None)
@given(buffer_lists())
def test_offsets_are_aligned_and_inside_an_arena_no_smaller_than_the_lower_bound(buffers):
    plan = plan_memory(buffers)
    for b in buffers:
        assert plan.offsets[b.name] % b.alignment == 0
        assert plan.offsets[b.name] + b.size <= plan.arena_bytes
    assert plan.arena_bytes >= plan.lower_bound
    assert plan.lower_bound >= max((b.size for b in buffers), default=0)


@settings(max_examples=100, deadline=None)
@given(buffer_lists())
def test_without_in_place_the_lower_bound_is_the_peak_of_live_bytes(buffers):
    plan = plan_memory(buffers, in_place=False)
    steps = range(max((b.last_use for b in buffers), default=0) + 1)
    assert plan.lower_bound == max((sum(b.size for b in buffers if b.first_use <= s <= b.last_use) for s in steps),
                                   default=0)
    assert not plan.aliases


def test_a_buffer_reuses_the_memory_of_one_that_died():
    plan = plan_memory([Lifetime("a", 1024, 0, 1), Lifetime("b", 1024, 1, 2), Lifetime("c", 1024, 2, 3)])
    assert plan.offsets["a"] == plan.offsets["c"] and plan.arena_bytes == 2048 == plan.lower_bound


def test_in_place_only_when_the_input_dies_where_the_output_is_born():
    legal = plan_memory([Lifetime("x", 64, 0, 1), Lifetime("y", 64, 1, 2, may_alias_input="x")])
    assert legal.aliases == {"y": "x"} and legal.offsets["x"] == legal.offsets["y"] and legal.arena_bytes == 64
    still_read_later = plan_memory([Lifetime("x", 64, 0, 2), Lifetime("y", 64, 1, 2, may_alias_input="x")])
    assert not still_read_later.aliases and still_read_later.arena_bytes == 128
    larger_output = plan_memory([Lifetime("x", 64, 0, 1), Lifetime("y", 128, 1, 2, may_alias_input="x")])
    assert not larger_output.aliases


def test_schedule_lifetimes_keep_inputs_from_the_start_and_outputs_to_the_end():
    steps = [(["in"], ["a"]), (["a"], ["b"]), (["b"], ["out"]), (["out"], ["tail"])]
    sizes = {"in": 4, "a": 4, "b": 4, "out": 4, "tail": 4}
    by_name = {b.name: b for b in lifetimes_for_schedule(steps, sizes, ["in"], ["out", "tail"])}
    assert (by_name["in"].first_use, by_name["in"].last_use) == (0, 0)
    assert (by_name["a"].first_use, by_name["a"].last_use) == (0, 1)
    assert (by_name["out"].first_use, by_name["out"].last_use) == (2, 3)
    assert by_name["tail"].last_use == 3


def test_dag_tensors_are_planned_over_the_cu_order():
    """x -> cu0 -> a -> cu1 -> b -> cu2 -> y, with cu2 also reading x: x lives to the end."""
    tensor = lambda n: {"dtype": "float32", "shape": [n // 4], "bytes": n}  # noqa: E731
    dag = {"inputs": [{"name": "x"}], "outputs": [{"name": "y"}],
           "tensors": {"x": tensor(1024), "a": tensor(4096), "b": tensor(4096), "y": tensor(64)},
           "cus": [{"id": "cu0", "inputs": ["x"], "outputs": ["a"]}, {"id": "cu1", "inputs": ["a"], "outputs": ["b"]},
                   {"id": "cu2", "inputs": ["b", "x"], "outputs": ["y"]}],
           "order": ["cu0", "cu1", "cu2"]}
    plan = plan_dag_memory(dag)
    assert plan.lower_bound == 1024 + 4096 + 4096  # cu1: x, a and b live
    assert plan.arena_bytes == plan.lower_bound
    ranges = sorted((plan.offsets[n], plan.offsets[n] + dag["tensors"][n]["bytes"]) for n in ("x", "b", "y"))
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:])), "cu2's tensors overlap"
    assert not plan.aliases


def _chain_model(shape=(4, 256)):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Relu", ["e"], ["r"]),
             helper.make_node("Sigmoid", ["r"], ["s"]), helper.make_node("Add", ["s", "e2"], ["y"]),
             helper.make_node("Neg", ["x"], ["e2"])]
    graph = helper.make_graph([nodes[0], nodes[4], nodes[1], nodes[2], nodes[3]], "chain", [x], [y])
    return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_elementwise_chain_runs_in_place(tmp_path):
    onnx.save(_chain_model(), tmp_path / "chain.onnx")
    graph = InferShapes().run(load_model(tmp_path / "chain.onnx"))
    plan = plan_graph_memory(graph)
    # the graph input x is never written over: the caller owns it
    assert plan.aliases == {"r": "e", "s": "r", "y": "s"}
    assert plan.offsets["e"] == plan.offsets["r"] == plan.offsets["s"] == plan.offsets["y"]
    # at most x, e and e2 are live together (Neg's step)
    assert plan.arena_bytes == plan.lower_bound == 3 * 4 * 256 * 4


def test_plan_memory_pass_records_the_plan_in_the_graph(tmp_path):
    onnx.save(_chain_model(), tmp_path / "chain.onnx")
    graph = PlanMemory().run(InferShapes().run(load_model(tmp_path / "chain.onnx")))
    recorded = json.loads(graph.metadata["cortex.memory_plan"])
    assert set(recorded["offsets"]) == {"x", "e", "e2", "r", "s", "y"}
    assert recorded["arena_bytes"] >= recorded["lower_bound"] > 0


def test_dynamic_shapes_are_refused_with_the_tensor_named(tmp_path):
    onnx.save(_chain_model(shape=("batch", 256)), tmp_path / "chain.onnx")
    with pytest.raises(CortexError, match="'x'.*not static"):
        plan_graph_memory(InferShapes().run(load_model(tmp_path / "chain.onnx")))


@pytest.mark.parametrize("name", [n for n in LIGHT_MODEL_NAMES if n in ("resnet50", "densenet121", "inception_v2", "squeezenet")])
def test_real_models_plan_within_ten_percent_of_the_lower_bound(name):
    case = light_model(name)
    graph, _ = run_pipeline(load_model(case.path), optimize_pipeline(case.input_shapes, require_static=True))
    plan = plan_graph_memory(graph)
    naive = sum(v.nbytes for v in graph.values() if not v.is_const)
    assert plan.arena_bytes <= 1.1 * plan.lower_bound
    assert plan.arena_bytes < naive / 4  # reuse actually happens
