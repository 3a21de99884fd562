"""`cortex compile-wasm`: one WebAssembly module per CU, recorded in dag.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from backends.wasm.build import compile_cu_dir
from backends.wasm.options import DEFAULT_FEATURES, FEATURES, OPT_LEVELS, TARGETS, parse_options
from cortex.console import print_json, print_summary


def compile_wasm(
    cu_dir: Annotated[Path, typer.Option("--cu-dir", help="The --output-dir of 'cortex decompose'.")],
    output: Annotated[Path, typer.Option("--output", help="Folder for cu-NNNN.wasm (replaced).")],
    dag: Annotated[Optional[Path], typer.Option("--dag", help="dag.json to record the artifacts in (rewritten).")] = None,
    target: Annotated[str, typer.Option("--target", help=f"One of: {', '.join(TARGETS)}.")] = TARGETS[0],
    features: Annotated[str, typer.Option("--features", help=f"Comma-separated subset of {','.join(FEATURES)}.")] = ",".join(DEFAULT_FEATURES),
    opt_level: Annotated[str, typer.Option("--opt-level", help=f"One of {', '.join(OPT_LEVELS)}: 0 plain loops, 1-3 more "
                                           "vectorisation and unrolling, s/z smaller code.")] = "2",
    emit_wat: Annotated[bool, typer.Option("--emit-wat", help="Also write cu-NNNN.wat next to each module.")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Compile every CU to a WebAssembly module (SIMD128 where enabled) that imports nothing."""
    options = parse_options(target, features, opt_level)
    summary = compile_cu_dir(cu_dir, output, options, dag, emit_wat)
    if json:
        print_json(summary)
        return
    print_summary(f"WebAssembly modules written to {output}", [
        ("CUs", str(summary["cus"])),
        ("bytes", f"{summary['bytes']:,}"),
        ("features / opt-level", f"{','.join(options.features) or 'none'} / {options.opt_level}"),
        ("dag.json updated", str(dag) if dag else "no (--dag not given)"),
        ("time", f"{summary['seconds']:.2f} s"),
    ])
