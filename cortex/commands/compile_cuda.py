"""`cortex compile-cuda`: CUDA C++, PTX and cubins per CU, recorded in dag.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from backends.cuda.build import compile_cu_dir
from backends.cuda.compile import COMPILERS, DEFAULT_ARCHS, choose_compiler, parse_archs
from cortex.console import print_json, print_summary


def compile_cuda(
    cu_dir: Annotated[Path, typer.Option("--cu-dir", help="The --output-dir of 'cortex decompose'.")],
    output: Annotated[Path, typer.Option("--output", help="Folder for cu-NNNN.{cu,ptx,sm_XX.cubin,weights} (replaced).")],
    dag: Annotated[Optional[Path], typer.Option("--dag", help="dag.json to record the artifacts in (rewritten).")] = None,
    arch: Annotated[str, typer.Option("--arch", help="Comma-separated GPU architectures for cubins.")] = ",".join(DEFAULT_ARCHS),
    compiler: Annotated[str, typer.Option("--compiler", help=f"One of {', '.join(COMPILERS)} (auto: nvcc when installed, else NVRTC).")] = "auto",
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Compile every CU to one CUDA translation unit, its PTX and a cubin per architecture."""
    archs = parse_archs(arch)
    choose_compiler(compiler)   # fail before any work when no compiler is usable
    summary = compile_cu_dir(cu_dir, output, archs, compiler, dag)
    if json:
        print_json(summary)
        return
    print_summary(f"CUDA artifacts written to {output}", [
        ("CUs / kernels", f"{summary['cus']} / {summary['kernels']}"),
        ("compiler / archs", f"{summary['compiler'] or 'none needed (no kernels)'} / {','.join(summary['archs'])}"),
        ("most registers in a kernel", str(summary["max_registers"])),
        ("kernels that spill", ", ".join(summary["spills"]) or "none"),
        ("dag.json updated", str(dag) if dag else "no (--dag not given)"),
        ("time", f"{summary['seconds']:.2f} s"),
    ])
