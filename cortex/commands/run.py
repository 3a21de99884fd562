"""`cortex run`: run a compiled dag.json on inputs from .npy/.npz files, write the outputs as .npz.
Its runtime flags are the fields of `RuntimeOptions` (cortex/runtime/options.py)."""

from __future__ import annotations

import io
import json as jsonlib
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from cortex.console import out, print_json
from cortex.commands.generated_options import with_options
from cortex.commands.shared_options import DeviceOption
from cortex.runtime import load
from cortex.runtime.options import RuntimeOptions
from ir.errors import CortexError
from ir.fs import write_bytes_atomically


@with_options(RuntimeOptions, into="runtime")
def run(
    dag: Annotated[Path, typer.Argument(help="The dag.json, compiled for the device.")],
    runtime: RuntimeOptions,
    input: Annotated[Optional[list[str]], typer.Option("--input", help="NAME=FILE.npy, or FILE.npz holding inputs by name (repeatable).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", help="The .npz file to write the outputs to.")] = None,
    device: DeviceOption = "wasm",
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write the run's trace (JSON, cortex.trace/1): CUs "
                                                  "activated, skipped and why, fallbacks, per-CU time and bytes, Chrome "
                                                  "trace events.")] = None,
    output_names: Annotated[Optional[str], typer.Option("--output-names", help="Comma-separated outputs to compute "
                                                        "(default: all); only the CUs they need run.")] = None,
    example_inputs: Annotated[bool, typer.Option("--example-inputs", help="Feed inputs not given with --input a "
                                                 "deterministic example (floats arange(n)/n, integers and bools 0).")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Run the model's CUs in order on the device and save its outputs."""
    requested = parse_output_names(output_names)
    feeds = read_inputs(input or [])
    model = load(dag, device, options=runtime)
    if example_inputs:
        feeds = {**example_feeds(model.inputs), **feeds}
    known = [spec["name"] for spec in model.outputs]
    unknown = [name for name in requested or [] if name not in known]
    if unknown:
        raise CortexError(f"--output-names: unknown output {', '.join(map(repr, unknown))}: the model's outputs are "
                          f"{', '.join(map(repr, known))}")
    results = model.run(feeds, outputs=requested)
    document = model.last_trace
    if output is not None:
        buffer = io.BytesIO()
        np.savez(buffer, **results)
        write_bytes_atomically(output, buffer.getvalue())
    if trace is not None:
        write_bytes_atomically(trace, (jsonlib.dumps(document, indent=2) + "\n").encode())
    summary = {"dag": str(dag), "device": device, "policy": runtime.policy.name, "output": str(output) if output else None,
               "outputs": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in results.items()},
               "seconds": round(document["total_seconds"], 6),
               "memory": document["memory"],
               "cus_by_device": document["cus_by_device"],
               "activated_cus": len(document["activated_cus"]),
               "skipped_cus": {reason: [s["cu"] for s in document["skipped_cus"] if s["reason"] == reason]
                               for reason in dict.fromkeys(s["reason"] for s in document["skipped_cus"])}}
    if json:
        print_json(summary)
        return
    for name, value in results.items():
        out.print(f"{name}: {value.dtype}{list(value.shape)}")
    if document["offline"] is not None:
        out.print(f"offline: the source model {document['offline']['model']} on onnxruntime in "
                  f"{summary['seconds'] * 1e3:.2f} ms" + (f"; outputs written to {output}" if output else ""))
        return
    others = ", ".join(f"{n} on {name}" for name, n in summary["cus_by_device"].items() if name != device)
    skipped = ", ".join(f"{len(ids)} {reason}" for reason, ids in summary["skipped_cus"].items())
    out.print(f"{len(model.trace)} CUs in {summary['seconds'] * 1e3:.2f} ms on {device}"
              + (f" ({others}: fallback)" if others else "")
              + (f", skipped: {skipped}" if skipped else "")
              + (f"; outputs written to {output}" if output else ""))


def parse_output_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise CortexError(f"--output-names {text!r}: expected comma-separated output names, such as y,logits")
    return names


def read_inputs(items: list[str]) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = None, item
        path = Path(path)
        if not path.is_file():
            raise CortexError(f"--input {item!r}: {path} does not exist")
        try:
            loaded = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise CortexError(f"--input {item!r}: {path} is not a .npy or .npz file ({e})") from None
        if isinstance(loaded, np.lib.npyio.NpzFile):
            if name is not None:
                if name not in loaded.files:
                    raise CortexError(f"--input {item!r}: {path} has no array named {name!r}")
                arrays = {name: loaded[name]}
            else:
                arrays = {k: loaded[k] for k in loaded.files}
        else:
            if name is None:
                raise CortexError(f"--input {item!r}: give the input's name, as NAME={path}")
            arrays = {name: loaded}
        for k, v in arrays.items():
            if k in feeds:
                raise CortexError(f"--input: {k!r} given twice")
            feeds[k] = v
    return feeds


def example_feeds(specs: list[dict]) -> dict[str, np.ndarray]:
    """The inputs the test suites use for models without data: arange(n)/n for floats, zeros
    otherwise (always a valid index, mask or flag)."""
    feeds = {}
    for spec in specs:
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        n = int(np.prod(shape, dtype=np.int64))
        if dtype.kind == "f":
            feeds[spec["name"]] = (np.arange(n) / max(n, 1)).astype(dtype).reshape(shape)
        else:
            feeds[spec["name"]] = np.zeros(shape, dtype)
    return feeds
