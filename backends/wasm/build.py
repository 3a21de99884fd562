"""The wasm target: one CU's graph -> `cu-NNNN.wasm` (+ `.wat` with `--emit-wat`) and its record.

The record in dag.json (`cus[i].artifacts.wasm`) holds the module's path relative to dag.json, its
sha256 and size, the options it was built with, and its memory plan (where the host writes inputs
and reads outputs).
"""

from __future__ import annotations

from backends.registry import BuiltCU
from backends.wasm.compile import compile_graph
from backends.wasm.options import WasmOptions
from ir.graph import Graph


def build_cu(graph: Graph, options: WasmOptions, cu_id: str) -> BuiltCU:
    artifact = compile_graph(graph, options)
    name = f"{cu_id}.wasm"
    files = {name: artifact.wasm}
    if options.emit_wat:
        files[f"{cu_id}.wat"] = artifact.wat.encode()
    record = {"file": name, "sha256": artifact.sha256, "bytes": len(artifact.wasm),
              "options": options.to_json(), "memory": artifact.plan}
    return BuiltCU(files, record)


def place(record: dict, folder: str) -> dict:
    """The record as dag.json holds it: the module's path instead of its file name."""
    placed = dict(record)
    placed["path"] = f"{folder}/{placed.pop('file')}"
    return placed


def summarize(records: dict[str, dict], options: WasmOptions) -> dict:
    return {"bytes": sum(r["bytes"] for r in records.values()), "options": options.to_json()}
