"""`cortex run`: run a compiled dag.json on inputs from .npy/.npz files, write the outputs as .npz."""

from __future__ import annotations

import io
import math
import json as jsonlib
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from backends.limits import AUTO_DEADLINE
from cortex.console import out, print_json
from cortex.commands.shared_options import (
    AddressOption,
    CuLoadTimeoutOption,
    CuTimeoutOption,
    DeviceOption,
    ExecutorOption,
    ExecutorOptionsOption,
    MemoryBudgetOption,
    PadToBucketOption,
    PadValueOption,
    PinOption,
    SpecializationsOption,
    ThreadsOption,
    checked_threads,
)
from cortex.runtime import load
from cortex.runtime.cache import DEFAULT_CACHE_BYTES
from cortex.runtime.memory import parse_pins
from cortex.runtime.policy import DEFAULT_POLICY, POLICIES
from cortex.runtime.policy import policy as resolve_policy
from ir.errors import CortexError
from ir.fs import write_bytes_atomically


def run(
    dag: Annotated[Path, typer.Argument(help="The dag.json, compiled for the device.")],
    input: Annotated[Optional[list[str]], typer.Option("--input", help="NAME=FILE.npy, or FILE.npz holding inputs by name (repeatable).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", help="The .npz file to write the outputs to.")] = None,
    device: DeviceOption = "wasm",
    cu_timeout_ms: CuTimeoutOption = None,
    cu_load_timeout_s: CuLoadTimeoutOption = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write the run's trace (JSON, cortex.trace/1): CUs "
                                                  "activated, skipped and why, fallbacks, per-CU time and bytes, Chrome "
                                                  "trace events.")] = None,
    policy: Annotated[str, typer.Option("--policy", help=f"What the scheduler may do: {', '.join(POLICIES)} (strict: "
                                        "every CU, exact, no cache; offline: the source model on onnxruntime).")]
    = DEFAULT_POLICY,
    trust_threshold: Annotated[Optional[float], typer.Option("--trust-threshold", help="The calibrated trust a "
                                                             "reduced-precision variant needs to run, in [0, 1] "
                                                             "(default: the policy's).")] = None,
    output_names: Annotated[Optional[str], typer.Option("--output-names", help="Comma-separated outputs to compute "
                                                        "(default: all); only the CUs they need run.")] = None,
    cache_bytes: Annotated[int, typer.Option("--cache-bytes", help="Byte budget of the result cache (0: off); it "
                                             "matters to repeated runs in one process, not to one 'cortex run'.")]
    = DEFAULT_CACHE_BYTES,
    memory_budget: MemoryBudgetOption = None,
    pin: PinOption = None,
    example_inputs: Annotated[bool, typer.Option("--example-inputs", help="Feed inputs not given with --input a "
                                                 "deterministic example (floats arange(n)/n, integers and bools 0).")] = False,
    pad_to_bucket: PadToBucketOption = None,
    pad_value: PadValueOption = 0.0,
    threads: ThreadsOption = None,
    specializations: SpecializationsOption = "lazy",
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
    executor: ExecutorOption = "local",
    address: AddressOption = None,
    executor_option: ExecutorOptionsOption = None,
) -> None:
    """Run the model's CUs in order on the device and save its outputs."""
    threads = checked_threads(threads)
    try:
        chosen = resolve_policy(policy)
    except CortexError as e:
        raise CortexError(f"--policy: {e}") from None
    if trust_threshold is not None:
        chosen = chosen.with_threshold(trust_threshold)
    if cache_bytes < 0:
        raise CortexError(f"--cache-bytes cannot be negative, got {cache_bytes}")
    requested = parse_output_names(output_names)
    feeds = read_inputs(input or [])
    model = load(dag, device, policy=chosen, cache_bytes=cache_bytes, pad_to_bucket=pad_to_bucket,
                 pad_value=pad_value, threads=threads, specializations=specializations,
                 **memory_options(memory_budget, pin),
                 **sandbox_options(cu_timeout_ms, cu_load_timeout_s),
                 **executor_keywords(executor, address, executor_option))
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
    summary = {"dag": str(dag), "device": device, "policy": chosen.name, "output": str(output) if output else None,
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


def sandbox_options(cu_timeout_ms: str | None, cu_load_timeout_s: float | None) -> dict:
    """The sandbox keywords of `cortex.load`, checked here so that an error names the option."""
    timeout = parse_cu_timeout(cu_timeout_ms)
    if cu_load_timeout_s is not None and not 0 < cu_load_timeout_s < float("inf"):
        raise CortexError(f"--cu-load-timeout-s must be a positive number of seconds, got {cu_load_timeout_s}")
    return {"cu_timeout_ms": timeout, "cu_load_timeout_s": cu_load_timeout_s}


def parse_cu_timeout(text: str | None) -> float | str | None:
    if text is None or text == AUTO_DEADLINE:
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise CortexError(f"--cu-timeout-ms must be a number of milliseconds, at least 0 (0: no limit), or "
                          f"'{AUTO_DEADLINE}', got {text!r}")
    return value
def memory_options(memory_budget: float | None, pin: str | None) -> dict:
    """`--memory-budget` and `--pin` as `load`'s keywords, checked in one line naming the option."""
    if memory_budget is not None and not (math.isfinite(memory_budget) and memory_budget > 0):
        raise CortexError(f"--memory-budget must be a positive number of MB, got {memory_budget:g}")
    pins = parse_pins(pin)
    if pins is not None and memory_budget is None:
        raise CortexError("--pin needs --memory-budget: without a budget every CU stays resident")
    return {"memory_budget_mb": memory_budget, "pins": pins}


def executor_keywords(executor: str, address: str | None, options: list[str] | None = None) -> dict:
    """`--executor`/`--address`/`--executor-option` as `cortex.load`'s keywords, checked with the
    options' names (the loader checks the keys and the executor their values)."""
    if executor not in ("local", "ray"):
        raise CortexError(f"--executor {executor}: expected local or ray")
    if address is not None and executor != "ray":
        raise CortexError("--address names a Ray cluster: it needs --executor ray")
    if options and executor != "ray":
        raise CortexError("--executor-option sets the ray executor: it needs --executor ray")
    parsed = {}
    for text in options or []:
        key, sep, value = text.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise CortexError(f"--executor-option {text!r}: expected KEY=VALUE, e.g. replicas=2")
        parsed[key.strip()] = _option_value(value.strip())
    return {"executor": executor, "address": address, **({"executor_options": parsed} if parsed else {})}


def _option_value(text: str):
    """A whole number, a number, true/false, or else the text itself (a folder)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


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
