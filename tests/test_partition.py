"""The partition's invariants, on small hand-made graphs and on random DAGs (hypothesis):
every node in exactly one CU, CUs convex (the CU graph is acyclic), fusion groups never cut,
depth <= --max-cu-depth, params <= --max-cu-size."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import networkx as nx
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from cortex.commands.decompose import decompose_model
from cortex.dag import build_dag
from cortex.tools.onnx_reference import run_dag
from ir.errors import CortexError
from ir.graph import Graph, outer_reads
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.fuse_groups import FuseGroups
from passes.partition import Partition, PartitionIntoCUs, partition_graph
from testdata import run_onnxruntime

WIDTH = 8


def random_model(seed: int, n_nodes: int) -> onnx.ModelProto:
    """A random DAG over [1, WIDTH] tensors: MatMuls with weights, bias Adds, Relus, and Adds/Muls
    joining two earlier values (which make diamonds, the shapes that test convexity)."""
    rng = np.random.default_rng(seed)
    values = ["x"]
    nodes, inits = [], []
    for i in range(n_nodes):
        kind = rng.choice(["matmul", "bias", "relu", "join", "join"])
        src = values[int(rng.integers(max(0, len(values) - 6), len(values)))]
        out = f"v{i}"
        if kind == "matmul":
            w = f"w{i}"
            inits.append(numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.3, w))
            nodes.append(helper.make_node("MatMul", [src, w], [out], name=f"n{i}"))
        elif kind == "bias":
            b = f"b{i}"
            inits.append(numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), b))
            nodes.append(helper.make_node("Add", [src, b], [out], name=f"n{i}"))
        elif kind == "relu":
            nodes.append(helper.make_node("Relu", [src], [out], name=f"n{i}"))
        else:
            other = values[int(rng.integers(0, len(values)))]
            nodes.append(helper.make_node(str(rng.choice(["Add", "Mul"])), [src, other], [out], name=f"n{i}"))
        values.append(out)
    # Every value nobody reads becomes an output, so no node is dead.
    read = {i for n in nodes for i in n.input}
    outputs = [v for v in values[1:] if v not in read] or [values[-1]]
    graph = helper.make_graph(nodes, "random", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, WIDTH]) for o in outputs],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def partitioned(model: onnx.ModelProto, **limits) -> tuple[Graph, Partition]:
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    graph, _ = run_pipeline(graph, [FuseGroups()])
    return graph, PartitionIntoCUs(**limits).run(graph)


def cu_graph_edges(graph: Graph, part: Partition) -> nx.DiGraph:
    cu_of = part.cu_of()
    g = nx.DiGraph()
    g.add_nodes_from(range(len(part.cus)))
    for node in graph.nodes:
        for v in [*node.present_inputs, *outer_reads(node)]:
            if v.producer is not None and cu_of[id(v.producer)] != cu_of[id(node)]:
                g.add_edge(cu_of[id(v.producer)], cu_of[id(node)])
    return g


def longest_path_in(cu_nodes) -> int:
    """Depth measured independently: the longest path where a fusion group is one op."""
    key = {id(n): (n.fusion_group or id(n)) for n in cu_nodes}
    g = nx.DiGraph()
    g.add_nodes_from(set(key.values()))
    for n in cu_nodes:
        for v in n.present_inputs:
            if v.producer is not None and id(v.producer) in key and key[id(v.producer)] != key[id(n)]:
                g.add_edge(key[id(v.producer)], key[id(n)])
    return nx.dag_longest_path_length(g) + 1


def assert_valid_partition(graph: Graph, part: Partition, max_cu_size, max_cu_depth) -> None:
    placed = [id(n) for cu in part.cus for n in cu.nodes]
    assert sorted(placed) == sorted(id(n) for n in graph.nodes), "every node in exactly one CU"
    edges = cu_graph_edges(graph, part)
    assert nx.is_directed_acyclic_graph(edges), "CUs must be convex (the CU graph acyclic)"
    assert all(u < v for u, v in edges.edges), "the CU list is in topological order"
    cu_of = part.cu_of()
    groups = {}
    for n in graph.nodes:
        if n.fusion_group is not None:
            groups.setdefault(n.fusion_group, set()).add(cu_of[id(n)])
    assert all(len(cus) == 1 for cus in groups.values()), "fusion groups are never cut"
    for cu in part.cus:
        assert cu.depth == longest_path_in(cu.nodes) <= max_cu_depth
        consts = {id(v): v.const.size for n in cu.nodes for v in n.present_inputs if v.is_const}
        assert cu.params == sum(consts.values())
        if max_cu_size is not None:
            assert cu.params <= max_cu_size


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_nodes=st.integers(1, 60),
       max_cu_depth=st.integers(1, 5), max_cu_size=st.sampled_from([40, 64, 100, 300, 1000, None]),  # 40 < a weight: splits
       min_cu_size=st.sampled_from([0, 50, 64, 10_000]))
def test_random_dags_partition_into_convex_cus_within_limits(seed, n_nodes, max_cu_depth, max_cu_size, min_cu_size):
    if max_cu_size is not None and min_cu_size > max_cu_size:
        min_cu_size = max_cu_size
    graph, part = partitioned(random_model(seed, n_nodes), min_cu_size=min_cu_size, max_cu_size=max_cu_size,
                              max_cu_depth=max_cu_depth)
    assert_valid_partition(graph, part, max_cu_size, max_cu_depth)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), max_cu_depth=st.integers(1, 6))
def test_merges_for_min_cu_size_never_break_convexity(seed, max_cu_depth):
    # A min size no CU reaches makes the merge phase try every neighbour of every CU.
    graph, part = partitioned(random_model(seed, 80), min_cu_size=10**9, max_cu_size=None,
                              max_cu_depth=max_cu_depth)
    assert_valid_partition(graph, part, None, max_cu_depth)
    for cu in part.cus:
        assert cu.small_reason, "a CU left under --min-cu-size says why"


def test_max_cu_depth_is_never_exceeded():
    graph, part = partitioned(random_model(7, 200), max_cu_depth=2, min_cu_size=0)
    assert max(cu.depth for cu in part.cus) == 2
    assert_valid_partition(graph, part, 1_000_000, 2)


def test_unlimited_depth_and_size_give_one_cu_for_a_connected_model():
    graph, part = partitioned(random_model(3, 40), max_cu_depth=1000, max_cu_size=None, min_cu_size=0)
    assert len(part.cus) == 1


def test_a_diamond_is_not_merged_around_its_middle():
    # a -> {b, c} -> d, where a and b cannot share a CU (their weights exceed the cap together):
    # {a, c, d} without b would not be convex (a -> b -> d leaves and re-enters), even though the
    # merge phase wants every CU merged (min size = max size).
    w = numpy_helper.from_array(np.ones((WIDTH, WIDTH), np.float32), "w")
    bias = numpy_helper.from_array(np.ones(WIDTH, np.float32), "bias")
    nodes = [helper.make_node("Add", ["x", "bias"], ["a"], name="a"),
             helper.make_node("MatMul", ["a", "w"], ["b"], name="b"),
             helper.make_node("Sigmoid", ["a"], ["c"], name="c"),
             helper.make_node("Sub", ["b", "c"], ["d"], name="d")]
    g = helper.make_graph(nodes, "diamond", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
                          [helper.make_tensor_value_info("d", TensorProto.FLOAT, [1, WIDTH])], [w, bias])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    cap = WIDTH * WIDTH
    graph, part = partitioned(model, max_cu_size=cap, min_cu_size=cap, max_cu_depth=10)
    assert_valid_partition(graph, part, cap, 10)
    cu_of = {n.name: i for i, cu in enumerate(part.cus) for n in cu.nodes}
    assert cu_of["a"] != cu_of["b"]
    assert cu_of["d"] != cu_of["a"], "d with a but without b would make a cycle"


def test_min_cu_size_merges_small_cus_into_neighbours():
    model = random_model(11, 120)
    _, loose = partitioned(model, min_cu_size=0, max_cu_depth=3)
    graph, merged = partitioned(model, min_cu_size=10_000, max_cu_depth=3)
    assert len(merged.cus) <= len(loose.cus)
    assert_valid_partition(graph, merged, 1_000_000, 3)


@pytest.mark.parametrize("limits, message", [
    (dict(min_cu_size=10, max_cu_size=5), "--min-cu-size 10 is larger than --max-cu-size 5"),
    (dict(max_cu_depth=0), "--max-cu-depth must be at least 1"),
    (dict(max_cu_size=0), "--max-cu-size must be at least 1"),
])
def test_bad_limits_are_user_errors(limits, message):
    with pytest.raises(CortexError, match=message):
        PartitionIntoCUs(**limits)


def test_partition_of_an_empty_graph_has_no_cus():
    assert partition_graph(Graph(), 256, 1_000_000, 3).cus == []


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_nodes=st.integers(1, 40), max_cu_depth=st.integers(1, 4),
       max_cu_size=st.sampled_from([40, 100, 1000]))
def test_random_dags_run_cu_by_cu_reproduce_the_model(seed, n_nodes, max_cu_depth, max_cu_size):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        onnx.save(random_model(seed, n_nodes), folder / "m.onnx")
        decompose_model(folder / "m.onnx", folder / "cus", PartitionIntoCUs(min_cu_size=min(64, max_cu_size),
                                                                            max_cu_size=max_cu_size,
                                                                            max_cu_depth=max_cu_depth))
        (folder / "dag.json").write_text(json.dumps(build_dag(folder / "cus", folder / "dag.json")))
        feeds = {"x": np.linspace(-2, 2, WIDTH, dtype=np.float32).reshape(1, WIDTH)}
        got, expected = run_dag(folder / "dag.json", feeds), run_onnxruntime(folder / "m.onnx", feeds)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)


def test_parallel_readers_of_a_model_input_share_cus_up_to_the_size_cap():
    n = 1000
    nodes = [helper.make_node("Mul", ["x", f"c{i}"], [f"y{i}"], name=f"m{i}") for i in range(n)]
    inits = [numpy_helper.from_array(np.array([i], np.float32), f"c{i}") for i in range(n)]
    g = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, 4]) for i in range(n)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    graph, part = partitioned(model, min_cu_size=0, max_cu_size=None, max_cu_depth=1)
    assert len(part.cus) == 1
    graph, part = partitioned(model, min_cu_size=100, max_cu_size=100, max_cu_depth=1)
    assert len(part.cus) == 10 and all(cu.params == 100 for cu in part.cus)
    assert_valid_partition(graph, part, 100, 1)
