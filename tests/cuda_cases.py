"""Shared helpers for the CUDA model tests: the CLI pipeline decompose -> build-dag -> compile-cuda,
as functions."""

from __future__ import annotations

import json
from pathlib import Path

from backends.cuda.build import compile_cu_dir
from cortex.commands.decompose import decompose_model
from cortex.dag import build_dag
from ir.onnx_export import write_bytes_atomically


def compile_cuda_pipeline(case, out_dir, compiler="auto", archs=("sm_80", "sm_90"), min_cu_size=4096,
                          max_cu_size=50_000_000, max_cu_depth=8) -> Path:
    """Returns the dag.json path with `artifacts.cuda` filled in."""
    out_dir = Path(out_dir)
    decompose_model(Path(case.path), out_dir / "cus", case.input_shapes or {}, case.dims or {}, min_cu_size,
                    max_cu_size, max_cu_depth)
    dag_path = out_dir / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out_dir / "cus", dag_path), indent=2).encode())
    compile_cu_dir(out_dir / "cus", out_dir / "cuda-bin", archs, compiler, dag_path)
    return dag_path
