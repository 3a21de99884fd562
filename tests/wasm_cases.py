"""Shared helpers for the WebAssembly tests: compile one ONNX model as one module and run it next to
onnxruntime, and write a one-CU folder (manifest + dag.json) the way `cortex decompose` does."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import wasmtime
from onnx import helper

from backends.wasm.assemble import make_engine
from backends.wasm.compile import compile_graph
from backends.wasm.device import WasmInstance
from backends.wasm.options import parse_options
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline

CONFIGS = [("", "0"), ("simd,bulk-memory", "3"), ("simd,bulk-memory,relaxed-simd", "3"), ("simd", "1")]


def make_model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def run_wasm(model: onnx.ModelProto, feeds: dict, features: str = "simd,bulk-memory", opt_level: str = "2"):
    graph = import_model(model)
    graph, _ = run_pipeline(graph, optimize_pipeline(require_static=True))
    options = parse_options(None, features, opt_level)
    artifact = compile_graph(graph, options)
    engine = make_engine(options)
    instance = WasmInstance(engine, wasmtime.Module(engine, artifact.wasm), artifact.plan)
    return {k: np.array(v) for k, v in instance.run(feeds).items()}


def run_onnxruntime(model: onnx.ModelProto, feeds: dict) -> dict:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def assert_matches_onnxruntime(model, feeds, configs=CONFIGS, rtol=1e-4, atol=1e-5):
    expected = run_onnxruntime(model, feeds)
    for features, level in configs:
        got = run_wasm(model, feeds, features, level)
        assert set(got) == set(expected)
        for name, want in expected.items():
            assert got[name].dtype == want.dtype, (name, features, level)
            assert got[name].shape == want.shape, (name, features, level)
            np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol,
                                       err_msg=f"{name} with features={features!r} opt-level={level}")
