"""`cortex calibrate`: measure every reduced-precision variant of a compiled dag.json on
calibration feeds and record its trust, agreement and the CUs' observed output ranges; with
`--hybrid`, measure instead the flops from which `--device hybrid` sends a CU to the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cortex.commands.run import example_feeds
from cortex.commands.shared_options import DeviceOption
from cortex.console import print_json, print_summary
from cortex.dag import read_dag
from cortex.tools.calibrate import calibrate as calibrate_dag
from cortex.tools.calibrate import read_feeds
from cortex.tools.crossover import record_crossover
from ir.errors import CortexError


def calibrate(
    dag: Annotated[Path, typer.Argument(help="The dag.json (rewritten): its variants' trust (compile --variants) "
                                             "and each CU's run and load time (the hot CUs a --memory-budget "
                                             "pins); for --hybrid compiled with compile-cuda too.")],
    data: Annotated[Path | None, typer.Option("--data", help="A folder of .npz feeds, or one .npz whose arrays have a "
                                              "leading batch axis (one feed per row). With --hybrid, optional: "
                                              "its first feed (else example inputs).")] = None,
    device: DeviceOption = "wasm",
    hybrid: Annotated[bool, typer.Option("--hybrid", help="Time each CU alone on the CPU and on the GPU of "
                                         "--device hybrid (or hybrid-sim) and record the crossover flops in "
                                         "dag.json, which that device then places by.")] = False,
    repeats: Annotated[int, typer.Option("--repeats", help="With --hybrid: timed runs per CU and device "
                                         "(the median counts).")] = 5,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Measure each variant against its exact CU and record its trust, and each CU's speed (its hot CUs), in
    dag.json (with --hybrid: the crossover flops of --device hybrid)."""
    if hybrid:
        _calibrate_hybrid(dag, data, device, repeats, json)
        return
    if data is None:
        raise CortexError("--data is required (a folder of .npz feeds, or one .npz) unless --hybrid is given")
    summary = calibrate_dag(dag, data, device)
    if json:
        print_json(summary)
        return
    rows = [(name, "not measured" if trust is None else f"trust {trust:.6f}")
            for name, trust in summary["variants"].items()]
    hot = summary["hot_cus"]
    print_summary(f"calibrated {len(rows)} variants on {summary['feeds']} feeds ({device}) and timed every CU "
                  f"({len(hot)} hot, pinned under --memory-budget{': ' + ', '.join(hot) if hot else ''}); "
                  f"{dag} updated", rows)


def _calibrate_hybrid(dag: Path, data: Path | None, device: str, repeats: int, as_json: bool) -> None:
    inputs = read_dag(dag)["inputs"]
    feed = read_feeds(data, inputs)[0] if data is not None else example_feeds(inputs)
    record = record_crossover(dag, device, feed, repeats)
    if as_json:
        print_json(record)
        return
    threshold = record["crossover_flops"]
    rows = [(cu_id, f"{t['flops']} flops: {t['cpu_device']} {t['cpu_ms']:.3f} ms, "
                    + f"{record['device']} {t['gpu_ms']:.3f} ms -> {t['placement']}") for cu_id, t in record["cus"].items()]
    where = "none, every CU stays on the CPU" if threshold is None else f"CUs of at least {threshold} flops go to the GPU"
    print_summary(f"hybrid crossover on {record['device']}: {where}; {dag} updated", rows)
