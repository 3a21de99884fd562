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
from backends.wasm.instance import WasmInstance
from backends.wasm.options import parse_options
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.partition import PartitionIntoCUs

from cortex.tools.exact_u8s8 import reference_source

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
    """onnxruntime's outputs; its uint8 x int8 products exact on every machine (cortex/tools/exact_u8s8.py)."""
    source, feeds, _ = reference_source(model, feeds)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
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


def compile_pipeline(model_path, out_dir, features="simd,bulk-memory", opt_level="2", input_shapes=None, dims=None,
                     min_cu_size=4096, max_cu_size=50_000_000, max_cu_depth=8):
    """decompose -> build-dag -> compile-wasm, as the CLI runs them; returns the dag.json path."""
    import json
    from pathlib import Path

    from backends.registry import target
    from cortex.compile import compile_cu_dir
    from cortex.commands.decompose import decompose_model
    from cortex.dag import build_dag
    from ir.fs import write_bytes_atomically

    out_dir = Path(out_dir)
    decompose_model(Path(model_path), out_dir / "cus", PartitionIntoCUs(min_cu_size, max_cu_size, max_cu_depth),
                    input_shapes=input_shapes, dims=dims)
    dag_path = out_dir / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out_dir / "cus", dag_path), indent=2).encode())
    compile_cu_dir(target("wasm"), out_dir / "cus", out_dir / "wasm-bin", parse_options(None, features, opt_level),
                   dag_path)
    return dag_path


def module_imports(path) -> list:
    """(module, name, kind) of every import of a .wasm file."""
    engine = wasmtime.Engine(_permissive_config())
    module = wasmtime.Module.from_file(engine, str(path))
    return [(i.module, i.name, type(i.type).__name__) for i in module.imports]


def _permissive_config():
    config = wasmtime.Config()
    config.wasm_simd = True
    config.wasm_relaxed_simd = True
    config.wasm_bulk_memory = True
    return config


def run_node_case(case, features="simd,bulk-memory,relaxed-simd", opt_level="3") -> dict:
    """An ONNX node test through the wasm backend. Inputs the lowering needs as constants (sizes,
    pads, axes, k) are frozen into the model when it says so, as a real model would have them."""
    from onnx import numpy_helper

    from ir.errors import CortexError
    model, feeds = onnx.load(case.path), dict(case.inputs)
    try:
        return run_wasm(model, feeds, features, opt_level)
    except CortexError as e:
        if "must be a constant" not in str(e):
            raise
    for vi in list(model.graph.input)[1:]:
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(feeds.pop(vi.name)), vi.name))
    first = list(model.graph.input)[:1]
    del model.graph.input[:]
    model.graph.input.extend(first)
    return run_wasm(model, feeds, features, opt_level)
