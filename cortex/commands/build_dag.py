"""`cortex build-dag`: turn a CU folder into dag.json (or Graphviz DOT)."""

from __future__ import annotations

import json as jsonlib
import time
from pathlib import Path
from typing import Annotated

import typer

from cortex.console import print_json, print_summary
from cortex.dag import build_dag as build_dag_document
from cortex.dag import to_dot
from cortex.specializations import build_specialized_dag, read_listing
from ir.errors import CortexError
from ir.fs import write_bytes_atomically

FORMATS = ("json", "dot")


def build_dag(
    cu_dir: Annotated[Path, typer.Option("--cu-dir", help="The --output-dir of 'cortex decompose'.")],
    output: Annotated[Path, typer.Option("--output", help="The dag.json (or .dot) file to write.")],
    format: Annotated[str, typer.Option("--format", help="json (dag.json, cortex.dag/1) or dot (Graphviz).")] = "json",
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Build the CU graph: tensors as edges, costs, topological order, levels, critical path."""
    if format not in FORMATS:
        raise CortexError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    if output.exists() and output.is_dir():
        raise CortexError(f"--output {output} is a folder; give a file name such as {output / 'dag.json'}")
    start = time.perf_counter()
    listing = read_listing(cu_dir)
    if listing is not None:
        if format != "json":
            raise CortexError(f"--format {format}: {cu_dir} holds specializations; only json lists them all")
        _write_specialized(cu_dir, output, listing, json, start)
        return
    dag = build_dag_document(cu_dir, output)
    text = jsonlib.dumps(dag, indent=2) + "\n" if format == "json" else to_dot(dag)
    write_bytes_atomically(output, text.encode())
    summary = {
        "output": str(output), "format": format, "cus": len(dag["cus"]), "edges": len(dag["edges"]),
        "levels": len(dag["levels"]), "widest_level": max((len(lv) for lv in dag["levels"]), default=0),
        "bytes_crossing_borders": sum(e["bytes"] for e in dag["edges"]),
        "critical_path": {"cus": len(dag["critical_path"]["cus"]), "flops": dag["critical_path"]["flops"]},
        "total_flops": sum(cu["flops"] for cu in dag["cus"]),
        "source_model": dag.get("source_model", {}).get("path"),
        "seconds": round(time.perf_counter() - start, 3),
    }
    if json:
        print_json(summary)
        return
    print_summary(f"CU graph written to {output}", [
        ("CUs / edges", f"{summary['cus']} / {summary['edges']}"),
        ("levels (widest)", f"{summary['levels']} ({summary['widest_level']})"),
        ("bytes crossing CU borders", f"{summary['bytes_crossing_borders']:,}"),
        ("critical path", f"{summary['critical_path']['cus']} CUs, {summary['critical_path']['flops']:,} flops"),
        ("total flops", f"{summary['total_flops']:,}"),
        ("source model", summary["source_model"] or "not found (moved or edited since decompose): "
                                                   "the offline policy cannot run"),
        ("time", f"{summary['seconds']:.2f} s"),
    ])


def _write_specialized(cu_dir: Path, output: Path, listing: list[dict], json: bool, start: float) -> None:
    dag = build_specialized_dag(cu_dir, output, listing)
    write_bytes_atomically(output, (jsonlib.dumps(dag, indent=2) + "\n").encode())
    summary = {"output": str(output), "format": "json", "schema": dag["schema"],
               "specializations": {s["name"]: {"cus": len(s["cus"]), "edges": len(s["edges"]),
                                               "input_shapes": s["input_shapes"]} for s in dag["specializations"]},
               "source_model": dag.get("source_model", {}).get("path"),
               "seconds": round(time.perf_counter() - start, 3)}
    if json:
        print_json(summary)
        return
    print_summary(f"CU graphs of {len(dag['specializations'])} specializations written to {output}", [
        *((name, f"{one['cus']} CUs, {one['edges']} edges") for name, one in summary["specializations"].items()),
        ("time", f"{summary['seconds']:.2f} s"),
    ])
