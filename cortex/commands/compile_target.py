"""`cortex compile-<target>`, one command per registered target: its options are the fields of
the target's options dataclass, the work is `cortex.compile.compile_cu_dir`. CUs already built
with the same inputs come from the compile cache (`--cache-dir`; `--no-cache` turns it off)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from backends.registry import Target
from cortex.commands.cache_options import CacheDir, CacheMaxMb, NoCache, open_cache
from cortex.commands.generated_options import with_options
from cortex.commands.shared_options import AddressOption, ExecutorOption
from cortex.compile import compile_cu_dir
from cortex.compile_cache import DEFAULT_MAX_MB
from cortex.console import print_json, print_summary
from cortex.runtime.ray_cluster import cu_map
from passes.narrow_weights import PRECISIONS


def compile_command(target: Target) -> Callable:
    def compile_target(
        cu_dir: Annotated[Path, typer.Option("--cu-dir", help="The --output-dir of 'cortex decompose'.")],
        output: Annotated[Path, typer.Option("--output", help="Folder for the artifacts (replaced as a whole).")],
        options: object,
        dag: Annotated[Optional[Path], typer.Option("--dag", help="dag.json to record the artifacts in (rewritten); "
                                                    "--output must lie in its folder.")] = None,
        json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
        variants: str = "",
        executor: ExecutorOption = "local",
        address: AddressOption = None,
        cache_dir: CacheDir = None,
        cache_max_mb: CacheMaxMb = DEFAULT_MAX_MB,
        no_cache: NoCache = False,
    ) -> None:
        summary = compile_cu_dir(target, cu_dir, output, options, dag, variants=variants,
                                 map_cus=cu_map(executor, address), cache=open_cache(cache_dir, cache_max_mb, no_cache))
        if json:
            print_json(summary)
            return
        rows = [(key.replace("_", " "), _text(value)) for key, value in summary.items()
                if key not in ("output", "dag", "seconds")]
        rows += [("dag.json updated", str(dag) if dag else "no (--dag not given)"),
                 ("time", f"{summary['seconds']:.2f} s")]
        print_summary(f"{target.name} artifacts written to {output}", rows)

    compile_target.__doc__ = target.description
    # Set here, not in the signature: string annotations are evaluated without this closure's `target`.
    compile_target.__annotations__["variants"] = Annotated[str, typer.Option("--variants",
                                                                             help=_variants_help(target))]
    return with_options(target.options, into="options")(compile_target)


def _variants_help(target: Target) -> str:
    own = "".join(f"; {p}: {v.description}" for p, v in target.variants.items())
    return (f"Also build variants, a comma-separated subset of {','.join((*PRECISIONS, *target.variants))} "
            f"({', '.join(PRECISIONS)}: each CU that has weights, with them stored so{own}); run 'cortex calibrate' "
            "before they are used.")


def _text(value) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "none"
    return "none" if value is None else str(value)
