"""`cortex verify`: run a compiled dag.json and compare every output with onnxruntime on the source
model, on the same inputs. Exit 0 when all outputs agree within tolerance, 1 when one does not.
Where this CPU's onnxruntime saturates uint8 x int8 products, the reference runs the model as
`cortex.runtime.exact_u8s8` rewrites it, whose products are exact, and the report says so.

`--bisect` also judges each CU on the inputs it received in that run (`cortex.runtime.bisect`) and
names the first CU whose own outputs diverge; `--dump DIR` writes that CU as a reproduction
(`cortex.runtime.repro`). The exit code stays the model's verdict.

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
from cortex.runtime.bisect import Bisection, BisectReport
from cortex.runtime.compare import compare
from cortex.runtime.exact_u8s8 import reference_source
from cortex.runtime.repro import write_reproduction
from cortex.runtime.specialized import SpecializedModel
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
    # The bisection names the first CU that diverges in dag.json's order: one thread keeps that order.
    compiled = load(dag, device, threads=1 if bisect else None)
    given = read_inputs(input or [])
    chosen = None
    if isinstance(compiled, SpecializedModel):
        i = compiled.select({name: list(np.shape(value)) for name, value in given.items()}, specialization)
        chosen, compiled = compiled.sections[i]["name"], compiled.specialization_model(i)
    elif specialization is not None:
        raise CortexError(f"--specialization {specialization}: {dag} was built for one input shape")
    _check_same_model(model, compiled.dag)
    frozen = _frozen_feeds(compiled.dag, given)
    feeds = {**example_feeds(compiled.inputs), **{k: v for k, v in given.items() if k not in frozen}}
    bisection = Bisection(compiled, rtol, atol) if bisect else None
    ours = compiled.run(feeds)
    reference, exact = _run_onnxruntime(model, {**feeds, **frozen}, list(ours))
    rows = [compare(name, ours[name], reference[name], rtol, atol) for name in ours]
    ok = all(r["ok"] for r in rows)
    report = bisection.report(ok) if bisection else None
    command = None
    if dump is not None and report.named is not None:
        command = write_reproduction(dump, compiled.dag, compiled.path, report.named, report.named_check, device,
                                     rtol, atol)
    if json:
        document = {"dag": str(dag), "model": str(model), "device": device, "rtol": rtol, "atol": atol,
                    "ok": ok, "outputs": rows, **({"specialization": chosen} if chosen else {}),
                    **({"reference_note": EXACT_U8S8_NOTE} if exact else {})}
        if report is not None:
            document["bisect"] = {**report.to_json(), "dump": str(dump) if command else None, "repro": command}
        print_json(document)
    else:
        shown = f"{dag} ({chosen})" if chosen else str(dag)
        table = Table(title=f"{shown} on {device} against onnxruntime (rtol {rtol:g}, atol {atol:g})")
        for col in ("output", "shape", "max abs error", "max rel error", "result"):
            table.add_column(col)
        for r in rows:
            table.add_row(r["name"], "x".join(map(str, r["shape"])) or "scalar", f"{r['max_abs_error']:.3g}",
                          f"{r['max_rel_error']:.3g}", "ok" if r["ok"] else "[red]MISMATCH[/red]")
        out.print(table)
        if exact:
            out.print(EXACT_U8S8_NOTE)
        if report is not None:
            _print_bisection(report, dump, command is not None)
    if not ok:
        raise typer.Exit(1)


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
    (`cortex.runtime.exact_u8s8`): without it, on a CPU where onnxruntime saturates uint8 x int8
    pair sums, a model's exact products would be judged against onnxruntime's wrong ones."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source, feeds, exact = reference_source(model, feeds, load=read_model_proto)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted}))), exact
