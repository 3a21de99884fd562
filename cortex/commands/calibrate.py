"""`cortex calibrate`: measure every reduced-precision variant of a compiled dag.json on
calibration feeds and record its trust, agreement and the CUs' observed output ranges."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cortex.commands.shared_options import DeviceOption
from cortex.console import print_json, print_summary
from cortex.runtime.calibrate import calibrate as calibrate_dag


def calibrate(
    dag: Annotated[Path, typer.Argument(help="The dag.json, compiled with --variants (rewritten).")],
    data: Annotated[Path, typer.Option("--data", help="A folder of .npz feeds, or one .npz whose arrays have a "
                                       "leading batch axis (one feed per row).")],
    device: DeviceOption = "wasm",
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Measure each variant against its exact CU and record its trust in dag.json."""
    summary = calibrate_dag(dag, data, device)
    if json:
        print_json(summary)
        return
    rows = [(name, "not measured" if trust is None else f"trust {trust:.6f}")
            for name, trust in summary["variants"].items()]
    print_summary(f"calibrated {len(rows)} variants on {summary['feeds']} feeds ({device}); {dag} updated", rows)
