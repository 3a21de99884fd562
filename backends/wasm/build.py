"""The wasm target: one CU's graph -> `cu-NNNN.wasm` (+ `.wat` with `--emit-wat`) and its record.

The record in dag.json (`cus[i].artifacts.wasm`) holds the module's path relative to dag.json, its
sha256 and size, the options it was built with, and its memory plan (where the host writes inputs
and reads outputs).
"""

from __future__ import annotations

from backends.registry import BuiltCU
from backends.wasm.compile import compile_graph
from backends.wasm.options import WasmOptions
from backends.wasm.weights_files import MODULES_FOLDER, weight_files
from ir.graph import Graph


def build_cu(graph: Graph, options: WasmOptions, cu_id: str) -> BuiltCU:
    artifact = compile_graph(graph, options)
    # Content-addressed names let builds that make the same module (or weights) store it once.
    stem = f"{MODULES_FOLDER}/{artifact.sha256}" if options.external_weights else cu_id
    name = f"{stem}.wasm"
    files = {name: artifact.wasm}
    if options.emit_wat:
        files[f"{stem}.wat"] = artifact.wat.encode()
    record = {"file": name, "sha256": artifact.sha256, "bytes": len(artifact.wasm),
              "options": options.to_json(), "memory": artifact.plan}
    if options.external_weights:
        weights, record["weights"] = weight_files(artifact.weights)
        files.update(weights)
    return BuiltCU(files, record)


def place(record: dict, folder: str) -> dict:
    """The record as dag.json holds it: the module's path instead of its file name."""
    placed = dict(record)
    placed["path"] = f"{folder}/{placed.pop('file')}"
    if "weights" in placed:
        placed["weights"] = [{"path": f"{folder}/{w['file']}", **{k: v for k, v in w.items() if k != "file"}}
                             for w in placed["weights"]]
    return placed


def summarize(records: dict[str, dict], options: WasmOptions) -> dict:
    """Bytes as stored: a content-addressed module or weight file shared by several CUs counts once."""
    stored = {r["file"]: r["bytes"] for r in records.values()}
    stored.update({w["file"]: w["bytes"] for r in records.values() for w in r.get("weights", ())})
    return {"bytes": sum(stored.values()), "options": options.to_json()}
