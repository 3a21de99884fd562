"""Small models for the runtime's policy, cache and trace tests, and how to build them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from backends.registry import device as device_spec
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from backends.registry import target
from ir.fs import write_bytes_atomically
from ir.options import from_text
from passes.partition import PartitionIntoCUs

WIDTH = 8


def _weight(rng, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), name)


def two_output_model() -> onnx.ModelProto:
    """x -> Relu -> h; y1 = MatMul(h, w1); y2 = MatMul(Tanh(MatMul(h, w2)), w3): two outputs that
    share h and need different CUs. The Relu lets two inputs that differ only in negative entries
    give the same h."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "w1"], ["y1"], name="matmul1"),
        helper.make_node("MatMul", ["h", "w2"], ["a"], name="matmul2"),
        helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
        helper.make_node("MatMul", ["t", "w3"], ["y2"], name="matmul3"),
    ]
    graph = helper.make_graph(nodes, "two_outputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, WIDTH])],
                              [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [4, WIDTH]),
                               helper.make_tensor_value_info("y2", TensorProto.FLOAT, [4, WIDTH])],
                              [_weight(rng, "w1"), _weight(rng, "w2"), _weight(rng, "w3")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def random_model() -> onnx.ModelProto:
    """h = MatMul(x, w); y = h + RandomUniformLike(h): a deterministic CU, then a random one."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
        helper.make_node("RandomUniformLike", ["h"], ["noise"], name="noise"),
        helper.make_node("Add", ["h", "noise"], ["y"], name="add"),
    ]
    graph = helper.make_graph(nodes, "noisy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, WIDTH])], [_weight(rng, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def build(model: onnx.ModelProto | Path, out: Path, fallback: str | None = None,
          cache_inputs: tuple[str, ...] = ()) -> Path:
    """decompose (one op per CU where fusion allows) -> build-dag -> compile-wasm; the dag.json.
    `cache_inputs` (decompose --cache-inputs) marks the CUs that depend only on those inputs
    repeating: the result cache keys nothing in a dag.json that marks nothing."""
    out = Path(out)
    if isinstance(model, onnx.ModelProto):
        path = out / f"{model.graph.name}.onnx"
        out.mkdir(parents=True, exist_ok=True)
        onnx.save(model, path)
    else:
        path = Path(model)
    decompose_model(path, out / "cus", PartitionIntoCUs(min_cu_size=0, max_cu_depth=1, fallback=fallback,
                                                                 cache_inputs=cache_inputs))
    dag_path = out / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out / "cus", dag_path), indent=2).encode())
    compile_cu_dir(target("wasm"), out / "cus", out / "wasm-bin", from_text(target("wasm").options), dag_path, jobs=1)
    return dag_path


def every_cu_in_order(dag_path: Path, feeds: dict[str, np.ndarray], device: str = "wasm") -> dict[str, np.ndarray]:
    """The runtime before policies, for a dag.json whose CUs all run on one device: every CU in
    dag.json's order, each output copied out once it is made."""
    dag = json.loads(Path(dag_path).read_text())
    cus = {cu["id"]: cu for cu in dag["cus"]}
    runner = device_spec(device).open(dag, Path(dag_path))
    runner.load([cus[i] for i in dag["order"]])
    env = {name: runner.to_device(np.asarray(value)) for name, value in feeds.items()}
    for cu_id in dag["order"]:
        results = runner.run(cus[cu_id], {name: env[name] for name in cus[cu_id]["inputs"]})
        env.update((name, runner.to_host(t)) for name, t in results.items())
    return {spec["name"]: np.asarray(env[spec["name"]]) for spec in dag["outputs"]}
