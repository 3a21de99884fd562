"""Compile a CU folder (the output of `cortex decompose`) into one .wasm module per CU.

Every CU is checked for unsupported ops before anything is compiled, so a model Cortex cannot
lower fails at once with one line naming the op types and nodes. The modules are written into a
temporary sibling of the output folder that replaces it only when all of them succeeded; dag.json,
when given, then gets each CU's artifact record (path, sha256, size, options, memory plan) and is
rewritten atomically.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from backends.wasm.compile import compile_graph
from backends.wasm.options import WasmOptions
from cortex.cus import read_manifest, write_directory_atomically
from cortex.pipeline import load_and_optimize
from ir.errors import CortexError, UnsupportedError
from ir.loops.builder import describe_unsupported, unsupported_nodes
from ir.onnx_export import write_bytes_atomically


def compile_cu_dir(cu_dir: Path, output: Path, options: WasmOptions, dag_path: Path | None = None,
                   emit_wat: bool = False, on_cu: Callable[[str], None] | None = None) -> dict:
    cu_dir, output = Path(cu_dir), Path(output)
    manifest = read_manifest(cu_dir)
    dag = _read_dag(dag_path, manifest, cu_dir) if dag_path is not None else None
    start = time.perf_counter()
    graphs = {}
    missing = []
    for cu in manifest["cus"]:
        graph = load_and_optimize(cu_dir / cu["path"], require_static=True).graph
        missing += unsupported_nodes(graph)
        graphs[cu["id"]] = graph
    if missing:
        raise UnsupportedError(f"{cu_dir}: cannot compile to WebAssembly: {describe_unsupported(missing)}")

    def fill(folder: Path) -> dict:
        records = {}
        for cu in manifest["cus"]:
            try:
                artifact = compile_graph(graphs[cu["id"]], options)
            except CortexError as e:
                raise type(e)(f"{cu['id']} ({cu_dir / cu['path']}): {e}") from None
            name = f"{cu['id']}.wasm"
            (folder / name).write_bytes(artifact.wasm)
            if emit_wat:
                (folder / f"{cu['id']}.wat").write_text(artifact.wat)
            records[cu["id"]] = {"file": name, "sha256": artifact.sha256, "bytes": len(artifact.wasm),
                                 "options": options.to_json(), "memory": artifact.plan}
            if on_cu:
                on_cu(cu["id"])
        index = {"schema": "cortex.wasm/1", "options": options.to_json(), "cus": records}
        (folder / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        return records

    records = write_directory_atomically(output, fill)
    if dag is not None:
        base = Path(os.path.relpath(output.resolve(), dag_path.resolve().parent))
        for cu in dag["cus"]:
            record = dict(records[cu["id"]])
            record["path"] = (base / record.pop("file")).as_posix()
            cu.setdefault("artifacts", {})["wasm"] = record
        write_bytes_atomically(dag_path, (json.dumps(dag, indent=2) + "\n").encode())
    return {"output": str(output), "dag": str(dag_path) if dag_path else None, "cus": len(records),
            "bytes": sum(r["bytes"] for r in records.values()), "options": options.to_json(),
            "seconds": round(time.perf_counter() - start, 3)}


def _read_dag(dag_path: Path, manifest: dict, cu_dir: Path) -> dict:
    """dag.json, checked to describe the same CUs as the manifest (not a stale one)."""
    dag_path = Path(dag_path)
    if not dag_path.is_file():
        raise CortexError(f"--dag {dag_path}: no such file (run 'cortex build-dag' first)")
    try:
        dag = json.loads(dag_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CortexError(f"--dag {dag_path}: not readable JSON: {e}") from None
    if not isinstance(dag, dict) or dag.get("schema") != "cortex.dag/1":
        raise CortexError(f"--dag {dag_path}: not a cortex.dag/1 document")
    by_id = {cu["id"]: cu for cu in manifest["cus"]}
    for cu in dag.get("cus", []):
        mine = by_id.get(cu.get("id"))
        if mine is None or mine["sha256"] != cu.get("sha256"):
            raise CortexError(f"--dag {dag_path} does not describe the CUs in {cu_dir} ({cu.get('id')} differs); "
                              "run 'cortex build-dag' again")
    if len(dag.get("cus", [])) != len(by_id):
        raise CortexError(f"--dag {dag_path} has {len(dag.get('cus', []))} CUs, {cu_dir} has {len(by_id)}; "
                          "run 'cortex build-dag' again")
    return dag
