"""`cortex verify`: run a compiled dag.json and compare every output with onnxruntime on the source
model, on the same inputs. Exit 0 when all outputs agree within tolerance, 1 when one does not.
Where this CPU's onnxruntime saturates uint8 x int8 products, the reference runs the model as
`cortex.tools.exact_u8s8` rewrites it, whose products are exact, and the report says so.

`--bisect` also judges each CU on the inputs it received in that run (`cortex.tools.bisect`) and
names the first CU whose own outputs diverge; `--dump DIR` writes that CU as a reproduction
(`cortex.tools.repro`). The exit code stays the model's verdict.

Beside the max errors, each output's cosine similarity with the reference and the agreement of
their top-1 along the last axis are reported (`cortex.tools.accuracy`); `--metric
cosine:0.999,top1:0.95` makes those the verdict instead of the tolerance, for models whose outputs
may not match elementwise (dynamic quantization). When an output is outside the tolerance, the
report says why in a line or two (`cortex.tools.drift`): quantization, a CU that computes
something else, or float errors adding up; to find out, the model runs once more under the
bisection when `--bisect` did not already observe the first run.

A dag.json of shape specializations is checked on one of them, bisection included: the one
`--specialization` names, else the one the shapes of the `--input`s select (the first when they
select several); inputs not given get that one's example."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import onnxruntime as ort
import typer
from rich.table import Table

from cortex.commands.run import example_feeds, read_inputs
from cortex.commands.shared_options import DeviceOption
from cortex.console import out, print_json
from cortex.runtime import load
from cortex.runtime.specialized import SpecializedModel
from cortex.tools.accuracy import metric_failures, parse_metric_gate
from cortex.tools.bisect import Bisection, BisectReport
from cortex.tools.compare import compare
from cortex.tools.drift import DriftCause, explain
from cortex.tools.exact_u8s8 import reference_source
from cortex.tools.repro import write_reproduction
from ir.errors import CortexError
from ir.fs import file_sha256, sha256_bytes
from ir.onnx_import import read_model_proto


def verify(
    dag: Annotated[Path, typer.Argument(help="The dag.json, compiled for the device.")],
    model: Annotated[Path, typer.Option("--model", help="The source ONNX model the dag was built from.")],
    input: Annotated[Optional[list[str]], typer.Option("--input", help="NAME=FILE.npy or FILE.npz (repeatable); "
                                                       "inputs not given get a deterministic example.")] = None,
    device: DeviceOption = "wasm",
    rtol: Annotated[float, typer.Option("--rtol")] = 1e-4,
    atol: Annotated[float, typer.Option("--atol")] = 1e-5,
    metric: Annotated[str | None, typer.Option("--metric", help="Judge by accuracy metrics instead of the "
                                               "tolerance: NAME:MIN,... with cosine (cosine similarity) and top1 "
                                               "(top-1 agreement along the last axis), e.g. cosine:0.999,top1:0.95."
                                               )] = None,
    bisect: Annotated[bool, typer.Option("--bisect", help="Also run each CU's cu.onnx on onnxruntime with the inputs "
                                         "the CU received, and name the first CU whose own outputs diverge.")] = False,
    dump: Annotated[Optional[Path], typer.Option("--dump", help="With --bisect: write that CU (or, when none "
                                                 "diverges, the one with the largest own error) to this folder as "
                                                 "a reproduction that 'sh DIR/repro.sh' checks again.")] = None,
    specialization: Annotated[str | None, typer.Option("--specialization", help="With shape specializations: "
                                                          "the one to check, by its name in dag.json (seq=64; "
                                                          "default: the one the --input shapes select).")] = None,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable report.")] = False,
) -> None:
    """Check a compiled model against onnxruntime: the same inputs must give the same outputs."""
    if not (rtol >= 0 and atol >= 0):       # also refuses NaN, which would pass nothing
        raise CortexError(f"--rtol {rtol:g} / --atol {atol:g}: tolerances must be zero or positive")
    if dump is not None and not bisect:
        raise CortexError(f"--dump {dump}: needs --bisect, which finds the CU to dump")
    gate = parse_metric_gate(metric) if metric is not None else None
    given = read_inputs(input or [])
    # The bisection names the first CU that diverges in dag.json's order: one thread keeps that order.
    chosen, compiled = _load(dag, device, given, specialization, bisect)
    _check_same_model(model, compiled.dag)
    frozen = _frozen_feeds(compiled.dag, given)
    feeds = {**example_feeds(compiled.inputs), **{k: v for k, v in given.items() if k not in frozen}}
    bisection = Bisection(compiled, rtol, atol) if bisect else None
    ours = compiled.run(feeds)
    reference, exact = _run_onnxruntime(model, {**feeds, **frozen}, list(ours))
    rows = [compare(name, ours[name], reference[name], rtol, atol) for name in ours]
    within_tolerance = all(r["ok"] for r in rows)
    if gate is not None:
        for r in rows:
            r["below_metric"] = metric_failures(r, gate)
    ok = within_tolerance if gate is None else not any(r["below_metric"] for r in rows)
    report = bisection.report(within_tolerance) if bisection else None
    cause = None
    if not within_tolerance:
        cause = explain(report or _bisect_again(dag, device, given, specialization, feeds, rtol, atol),
                        compiled.dag)
    command = None
    if dump is not None and report.named is not None:
        command = write_reproduction(dump, compiled.dag, compiled.path, report.named, report.named_check, device,
                                     rtol, atol)
    if json:
        document = {"dag": str(dag), "model": str(model), "device": device, "rtol": rtol, "atol": atol,
                    "ok": ok, "within_tolerance": within_tolerance, "metric": gate, "outputs": rows,
                    **({"specialization": chosen} if chosen else {}),
                    **({"explanation": cause.to_json()} if cause else {}),
                    **({"reference_note": EXACT_U8S8_NOTE} if exact else {})}
        if report is not None:
            document["bisect"] = {**report.to_json(), "dump": str(dump) if command else None, "repro": command}
        print_json(document)
    else:
        shown = f"{dag} ({chosen})" if chosen else str(dag)
        judged = f"rtol {rtol:g}, atol {atol:g}" + (f"; verdict by --metric {metric}" if gate else "")
        table = Table(title=f"{shown} on {device} against onnxruntime ({judged})")
        for col in ("output", "shape", "max abs error", "max rel error", "cosine", "top-1", "result"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["name"], "x".join(map(str, r["shape"])) or "scalar", f"{r['max_abs_error']:.3g}",
                          f"{r['max_rel_error']:.3g}", _metric_cell(r["cosine"]), _metric_cell(r["top1"]),
                          _result_cell(r, gate))
        out.print(table)
        if exact:
            out.print(EXACT_U8S8_NOTE)
        if cause is not None:
            for line in cause.lines:
                out.print(line)
        if report is not None:
            _print_bisection(report, dump, command is not None)
    if not ok:
        raise typer.Exit(1)


def _metric_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


def _result_cell(row: dict, gate: dict | None) -> str:
    if gate is None:
        return "ok" if row["ok"] else "[red]MISMATCH[/red]"
    if row["below_metric"]:
        return "[red]BELOW " + "; ".join(row["below_metric"]) + "[/red]"
    return "ok" if row["ok"] else "ok by metric (outside tolerance)"


def _load(dag: Path, device: str, given: dict, specialization: str | None, one_thread: bool):
    """(the specialization's name or None, the compiled model to check). On one thread (the
    bisection's), every CU runs with a call of its own, so that each one's inputs are observed."""
    compiled = load(dag, device, threads=1, segments=False) if one_thread else load(dag, device)
    if isinstance(compiled, SpecializedModel):
        i = compiled.select({name: list(np.shape(value)) for name, value in given.items()}, specialization, given)
        return compiled.sections[i]["name"], compiled.specialization_model(i)
    if specialization is not None:
        raise CortexError(f"--specialization {specialization}: {dag} was built for one input shape")
    return None, compiled


def _bisect_again(dag: Path, device: str, given: dict, specialization: str | None, feeds: dict, rtol: float,
                  atol: float) -> BisectReport:
    """The same model and feeds run once more under the bisection, to explain a difference."""
    _, compiled = _load(dag, device, given, specialization, True)
    bisection = Bisection(compiled, rtol, atol)
    compiled.run(feeds)
    return bisection.report(False)


def _print_bisection(report: BisectReport, dump: Path | None, dumped: bool) -> None:
    table = Table(title="each CU on its own inputs against onnxruntime")
    for col in ("CU", "device", "ops", "output", "max abs error", "max rel error", "result"):
        table.add_column(col)
    for check in report.checks:
        for i, r in enumerate(check.outputs):
            result = "not compared (random ops)" if not check.compared else "ok" if r["ok"] else "[red]DIVERGES[/red]"
            first = i == 0      # the CU's columns once, on its first output's row
            table.add_row(check.cu if first else "", check.device if first else "",
                          ", ".join(check.op_types) if first else "", r["name"], f"{r['max_abs_error']:.3g}",
                          f"{r['max_rel_error']:.3g}", result)
    out.print(table)
    out.print(report.summary())
    if dump is not None and not dumped:
        out.print(f"--dump {dump}: no compiled CU ran, nothing written")
    elif dump is not None:
        out.print(f"{report.named_check.cu} written to {dump}; reproduce with: sh {dump / 'repro.sh'}")


def _frozen_feeds(dag: dict, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The values of inputs frozen at decompose (`--freeze-input`), which the compiled model no
    longer takes but onnxruntime, running the source model, needs: each must be given again and be
    the very value that was frozen."""
    frozen = {}
    for entry in dag.get("options", {}).get("frozen_inputs", []):
        name = entry["name"]
        if name not in given:
            raise CortexError(f"input {name!r} was frozen at decompose (--freeze-input); give the same value with "
                              f"--input {name}=FILE.npy so that onnxruntime can run the source model")
        value = np.asarray(given[name]).astype(entry["dtype"])
        if list(value.shape) != entry["shape"] or sha256_bytes(np.ascontiguousarray(value).tobytes()) != entry["sha256"]:
            raise CortexError(f"--input {name}: not the value frozen at decompose (its sha256 differs); the "
                              "compiled model is specialised for that value only")
        frozen[name] = value
    return frozen


def _check_same_model(model: Path, dag: dict) -> None:
    if not model.is_file():
        raise CortexError(f"--model {model}: no such file")
    expected = dag.get("model", {}).get("sha256")
    actual = file_sha256(model)
    if expected and expected != actual:
        raise CortexError(f"--model {model} is not the model this dag.json was built from (sha256 differs)")


EXACT_U8S8_NOTE = ("onnxruntime on this CPU saturates uint8 x int8 products (no VNNI): the reference ran the "
                   "model with its int8 operands and zero points shifted to uint8, which gives the exact products")


def _run_onnxruntime(model: Path, feeds: dict, names: list[str]) -> tuple[dict[str, np.ndarray], bool]:
    """onnxruntime's outputs of the source model, and whether they come from its exact-u8s8 rewrite
    (`cortex.tools.exact_u8s8`): without it, on a CPU where onnxruntime saturates uint8 x int8
    pair sums, a model's exact products would be judged against onnxruntime's wrong ones."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source, feeds, exact = reference_source(model, feeds, load=read_model_proto)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted}))), exact
