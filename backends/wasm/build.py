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
from cortex.artifacts import read_cus_for_target, read_dag_for_cus, write_dag
from ir.fs import write_directory_atomically
from ir.errors import CortexError


def compile_cu_dir(cu_dir: Path, output: Path, options: WasmOptions, dag_path: Path | None = None,
                   emit_wat: bool = False, on_cu: Callable[[str], None] | None = None) -> dict:
    cu_dir, output = Path(cu_dir), Path(output)
    start = time.perf_counter()
    manifest, graphs = read_cus_for_target(cu_dir, "WebAssembly")
    dag = read_dag_for_cus(dag_path, manifest, cu_dir) if dag_path is not None else None

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
        write_dag(dag, dag_path)
    return {"output": str(output), "dag": str(dag_path) if dag_path else None, "cus": len(records),
            "bytes": sum(r["bytes"] for r in records.values()), "options": options.to_json(),
            "seconds": round(time.perf_counter() - start, 3)}
