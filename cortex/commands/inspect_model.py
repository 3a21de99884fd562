"""`cortex inspect MODEL`: what is in a model and what the optimisation pipeline makes of it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from backends.registry import targets
from codegen.lower import unsupported_nodes
from cortex.console import out, print_json
from cortex.options import parse_dims, parse_input_shapes
from cortex.pipeline import load_and_optimize
from cortex.summary import GraphSummary, summarize_graph
from ir.errors import CortexError
from ir.ops import REGISTRY, lowering_route

InputShapes = Annotated[Optional[list[str]], typer.Option("--input-shape", help="Bind an input: NAME=1x3x224x224 (repeatable).")]
Dims = Annotated[Optional[list[str]], typer.Option("--dim", help="Bind a named dynamic dim: NAME=N (repeatable).")]


def inspect(
    model: Annotated[Path, typer.Argument(help="The ONNX model file.")],
    input_shape: InputShapes = None,
    dim: Dims = None,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable report.")] = False,
) -> None:
    """Show a model's interface, ops, parameters and dynamic dims, and what the passes make of it."""
    shapes, dims = parse_input_shapes(input_shape), parse_dims(dim)
    bound = bool(shapes or dims)
    try:
        result = load_and_optimize(model, shapes, dims, require_static=False)
    except CortexError:
        raise
    after = summarize_graph(result.graph, backends=_backends())
    report = {
        "model": str(model),
        "source": result.source.to_json(),
        "optimized": after.to_json(),
        "passes": [{"name": r.name, "nodes_before": r.nodes_before, "nodes_after": r.nodes_after,
                    "seconds": round(r.seconds, 4)} for r in result.records],
        "inputs_bound": bound,
        "fallback": _fallback(result.graph),
        "lowering": _lowering(list(result.source.op_counts) + list(after.op_counts)),
    }
    if json:
        print_json(report)
        return
    _print_report(model, result.source, after, result.records, report["lowering"])
    if report["fallback"]["nodes"]:
        fallback = report["fallback"]
        out.print(f"nodes no target lowers: {fallback['nodes']} ({', '.join(fallback['ops'])}); "
                  "'cortex decompose --fallback onnxruntime' puts them in CUs that run on onnxruntime")


def _fallback(graph) -> dict:
    """What `decompose --fallback` would hand to the fallback runtime: the nodes no target lowers."""
    nodes = unsupported_nodes(graph)
    return {"nodes": len(nodes), "ops": sorted({n.op_type if not n.domain else f"{n.domain}::{n.op_type}"
                                                for n in nodes})}


def _lowering(ops: list[str]) -> dict[str, dict]:
    """For each op of the model, as stored and as optimised: how each target computes it, and
    whether it can run only in a fallback CU (no target computes it)."""
    report = {}
    for op in dict.fromkeys(ops):
        domain, _, op_type = op.rpartition("::")
        routes = {name: lowering_route(op_type, domain, t.lowering) for name, t in sorted(targets().items())}
        report[op] = {"targets": routes, "fallback_only": all(r == "none" for r in routes.values())}
    return report


def _backends() -> tuple[str, ...]:
    return tuple(sorted({b for entry in REGISTRY.values() for b in entry.lowerings}))


def _print_report(model: Path, source: GraphSummary, after: GraphSummary, records, lowering: dict) -> None:
    out.print(f"[bold]{model}[/bold]  opsets: " + ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in source.opsets.items()))
    io = Table(title="Interface (after binding and shape inference)", show_lines=False)
    for col in ("", "name", "dtype", "shape"):
        io.add_column(col)
    for kind, items in (("input", after.inputs), ("output", after.outputs)):
        for t in items:
            io.add_row(kind, t.name, t.dtype, "?" if t.shape is None else "x".join("?" if d is None else str(d) for d in t.shape) or "scalar")
    out.print(io)
    ops = Table(title="Ops (how each target computes them; fallback: only in a CU run on onnxruntime)")
    ops.add_column("op", overflow="fold"); ops.add_column("source", justify="right"); ops.add_column("optimized", justify="right")
    names = sorted({name for entry in lowering.values() for name in entry["targets"]})
    for name in names:
        ops.add_column(name)
    for op in sorted(set(source.op_counts) | set(after.op_counts), key=lambda o: -source.op_counts.get(o, 0)):
        routes = lowering[op]["targets"]
        ops.add_row(op, str(source.op_counts.get(op, 0)), str(after.op_counts.get(op, 0)),
                    *(routes[name] if routes[name] != "none" else "fallback" for name in names))
    ops.add_row("[bold]total[/bold]", str(source.node_count), str(after.node_count), *("" for _ in names))
    out.print(ops)
    out.print(f"parameters: {after.param_count:,} ({after.param_bytes / 1e6:.2f} MB) after folding; "
              f"{source.param_count:,} as stored")
    out.print("dynamic dims: " + (", ".join(after.dynamic_dims) or "none"))
    if after.unknown_shapes:
        first = ", ".join(after.unknown_shapes[:3]) + (", ..." if len(after.unknown_shapes) > 3 else "")
        out.print(f"values without a static shape: {len(after.unknown_shapes)} ({first})")
    out.print("control flow: " + (", ".join(after.control_flow) or "none"))
    if after.unknown_ops:
        out.print("ops unknown to Cortex: " + ", ".join(after.unknown_ops))
    for backend, missing in after.unlowered_ops.items():
        out.print(f"ops without a {backend} lowering: " + (", ".join(missing) or "none"))
    passes = Table(title="Pass pipeline")
    for col in ("pass", "nodes before", "nodes after", "ms"):
        passes.add_column(col, justify="right" if col != "pass" else "left")
    for r in records:
        passes.add_row(r.name, str(r.nodes_before), str(r.nodes_after), f"{r.seconds * 1000:.1f}")
    out.print(passes)
