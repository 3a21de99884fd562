"""What every backend's compile step shares: the CU folder it reads, the dag.json it must match,
and the record of its artifacts written back into dag.json. A backend adds its own files only."""

from __future__ import annotations

import json
from pathlib import Path

from cortex.cus import read_manifest
from cortex.dag import read_dag
from cortex.pipeline import load_and_optimize
from ir.errors import CortexError, UnsupportedError
from ir.graph import Graph
from ir.loops.builder import describe_unsupported, unsupported_nodes
from ir.fs import write_bytes_atomically


def read_cus_for_target(cu_dir: Path, target: str) -> tuple[dict, dict[str, Graph]]:
    """The manifest and each CU's optimised graph; fails at once, in one line, when any CU holds
    ops without a loop-nest lowering, before anything is compiled."""
    manifest = read_manifest(cu_dir)
    graphs, missing = {}, []
    for cu in manifest["cus"]:
        graph = load_and_optimize(cu_dir / cu["path"], require_static=True).graph
        missing += unsupported_nodes(graph)
        graphs[cu["id"]] = graph
    if missing:
        raise UnsupportedError(f"{cu_dir}: cannot compile to {target}: {describe_unsupported(missing)}")
    return manifest, graphs


def read_dag_for_cus(dag_path: Path, manifest: dict, cu_dir: Path) -> dict:
    """dag.json, checked to describe the same CUs as the manifest (not a stale one)."""
    dag = read_dag(dag_path, option="--dag")
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


def write_dag(dag: dict, dag_path: Path) -> None:
    write_bytes_atomically(Path(dag_path), (json.dumps(dag, indent=2) + "\n").encode())
