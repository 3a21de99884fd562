"""`cortex run`: run a compiled dag.json on inputs from .npy/.npz files, write the outputs as .npz."""

from __future__ import annotations

import io
import json as jsonlib
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from cortex.console import out, print_json
from cortex.commands.shared_options import DeviceOption
from cortex.runtime import load
from ir.errors import CortexError
from ir.fs import write_bytes_atomically


def run(
    dag: Annotated[Path, typer.Argument(help="The dag.json, compiled for the device.")],
    input: Annotated[Optional[list[str]], typer.Option("--input", help="NAME=FILE.npy, or FILE.npz holding inputs by name (repeatable).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", help="The .npz file to write the outputs to.")] = None,
    device: DeviceOption = "wasm",
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write per-CU wall time and bytes moved (JSON).")] = None,
    example_inputs: Annotated[bool, typer.Option("--example-inputs", help="Feed inputs not given with --input a "
                                                 "deterministic example (floats arange(n)/n, integers and bools 0).")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Run the model's CUs in order on the device and save its outputs."""
    feeds = read_inputs(input or [])
    model = load(dag, device)
    if example_inputs:
        feeds = {**example_feeds(model.inputs), **feeds}
    results = model.run(feeds)
    if output is not None:
        buffer = io.BytesIO()
        np.savez(buffer, **results)
        write_bytes_atomically(output, buffer.getvalue())
    if trace is not None:
        write_bytes_atomically(trace, (jsonlib.dumps(model.trace_document(), indent=2) + "\n").encode())
    summary = {"dag": str(dag), "device": device, "output": str(output) if output else None,
               "outputs": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in results.items()},
               "seconds": round(sum(t["seconds"] for t in model.trace), 6),
               "cus_by_device": model.trace_document()["cus_by_device"]}
    if json:
        print_json(summary)
        return
    for name, value in results.items():
        out.print(f"{name}: {value.dtype}{list(value.shape)}")
    others = ", ".join(f"{n} on {name}" for name, n in summary["cus_by_device"].items() if name != device)
    out.print(f"{len(model.trace)} CUs in {summary['seconds'] * 1e3:.2f} ms on {device}"
              + (f" ({others}: fallback)" if others else "")
              + (f"; outputs written to {output}" if output else ""))


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
