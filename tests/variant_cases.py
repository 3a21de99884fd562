"""A small model whose weights dominate its artifacts (an embedding table, a MatMul, a Gemm with
transB), compiled with reduced-precision variants, and the references the variants must meet:
onnxruntime on the same model with the weights replaced by their narrowed values, computed here
with numpy (not with the pass under test)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from backends.registry import target
from backends.wasm.options import parse_options
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from ir.fs import write_bytes_atomically
from passes.partition import PartitionIntoCUs

ROWS, VOCAB, WIDTH, HIDDEN, OUT = 8, 1000, 64, 256, 64


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"table": rng.standard_normal((VOCAB, WIDTH)).astype(np.float32),
            "w1": (rng.standard_normal((WIDTH, HIDDEN)) / np.sqrt(WIDTH)).astype(np.float32),
            "b1": rng.standard_normal(HIDDEN).astype(np.float32) * 0.1,
            "w2": (rng.standard_normal((OUT, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)}


def embedding_mlp(w: dict[str, np.ndarray]) -> onnx.ModelProto:
    """y = Gemm(Relu((Gather(table, ids) + x) @ w1 + b1), w2, transB=1)."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["embedded"], axis=0),
             helper.make_node("Add", ["embedded", "x"], ["summed"]),
             helper.make_node("MatMul", ["summed", "w1"], ["hidden"]),
             helper.make_node("Add", ["hidden", "b1"], ["biased"]),
             helper.make_node("Relu", ["biased"], ["active"]),
             helper.make_node("Gemm", ["active", "w2"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "embedding_mlp",
                              [helper.make_tensor_value_info("ids", T.INT64, [ROWS]),
                               helper.make_tensor_value_info("x", T.FLOAT, [ROWS, WIDTH])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [ROWS, OUT])],
                              [numpy_helper.from_array(v, k) for k, v in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def narrowed_reference(w: dict[str, np.ndarray], precision: str) -> dict[str, np.ndarray]:
    """The weights as a variant stores them, widened back to float32: per output channel for int8
    (table: its columns, w1 [K, N]: its columns, w2 [N, K] (transB): its rows); b1 stays float32."""
    def narrow(array, channel_axis):
        if precision == "fp16":
            return array.astype(np.float16).astype(np.float32)
        if precision == "bf16":
            return array.astype(ml_dtypes.bfloat16).astype(np.float32)
        other = tuple(d for d in range(array.ndim) if d != channel_axis)
        scale = np.abs(array).max(axis=other, keepdims=True) / 127.0
        return (np.clip(np.round(array / scale), -127, 127) * scale).astype(np.float32)
    return {"table": narrow(w["table"], 1), "w1": narrow(w["w1"], 1), "b1": w["b1"], "w2": narrow(w["w2"], 0)}


def feeds(count: int, seed: int, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, VOCAB, ROWS).astype(np.int64),
             "x": (rng.standard_normal((ROWS, WIDTH)) * scale).astype(np.float32)} for _ in range(count)]


def run_onnxruntime(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def build(out: Path, variants=("fp16", "bf16", "int8"), seed: int = 0) -> Path:
    """decompose (one CU per contraction) -> build-dag -> compile-wasm --variants; the dag.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = out / "model.onnx"
    onnx.save(embedding_mlp(weights(seed)), model_path)
    decompose_model(model_path, out / "cus", PartitionIntoCUs(min_cu_size=16, max_cu_size=1_000_000, max_cu_depth=1))
    dag_path = out / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out / "cus", dag_path), indent=2).encode())
    return recompile(out, variants)


def recompile(out: Path, variants=("fp16", "bf16", "int8"), opt_level: str = "2") -> Path:
    """compile-wasm again over the same CU folder and dag.json."""
    dag_path = Path(out) / "dag.json"
    compile_cu_dir(target("wasm"), Path(out) / "cus", Path(out) / "wasm-bin", parse_options(None, "simd", opt_level),
                   dag_path, variants=variants)
    return dag_path


def set_trust(dag_path: Path, trusts: dict[str, float | None]) -> None:
    """Give every CU's variants these trusts (a hand-made calibration) and wide output ranges."""
    dag = json.loads(Path(dag_path).read_text())
    for cu in dag["cus"]:
        for precision, variant in cu.get("variants", {}).items():
            variant["trust"] = trusts.get(precision)
    Path(dag_path).write_text(json.dumps(dag, indent=2))
