"""`cortex decompose`: optimise a model, fuse, partition it into CUs and write one ONNX model per CU
plus manifest.json."""

from __future__ import annotations

import json as jsonlib
import statistics
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from codegen.lower import unsupported_nodes
from cortex.commands.generated_options import with_options
from cortex.commands.inspect_model import Dims, InputShapes
from cortex.commands.run import read_inputs
from cortex.console import out, print_json, print_summary
from cortex.cus import check_output_dir, model_info, write_cus
from cortex.decoder_io import GENERATION_LIMITS, generation_specializations
from cortex.options import parse_dims, parse_input_shapes
from cortex.pipeline import load_and_optimize
from cortex.shared_cu_weights import share_cu_weights
from cortex.specializations import LISTING, Specialization, listing_document, parse_specializations, with_values
from cortex.value_specializations import parse_specialize, value_rows
from ir.errors import CortexError
from ir.onnx_import import load_model
from ir.fs import write_directory_atomically
from passes import run_pipeline
from passes.freeze_inputs import frozen_summary
from passes.fuse_groups import FuseGroups
from passes.partition import Partition, PartitionIntoCUs

@with_options(PartitionIntoCUs, into="limits")
def decompose(
    model_path: Annotated[Path, typer.Option("--model-path", help="The ONNX model file.")],
    output_dir: Annotated[Path, typer.Option("--output-dir", help="Folder for cu-NNNN/cu.onnx and manifest.json (replaced).")],
    limits: PartitionIntoCUs,
    input_shape: InputShapes = None,
    dim: Dims = None,
    freeze_input: Annotated[Optional[list[str]], typer.Option("--freeze-input", help="NAME=FILE.npy, or an .npz of arrays by name: the input becomes a constant with that value (repeatable).")] = None,
    specialize: Annotated[Optional[list[str]], typer.Option("--specialize", help="NAME=V1,V2,...: one specialization per value of a one-element input (an If decided by it), built as if frozen to it, in one bundle; NAME alone: the values the model's If compares it with (repeatable).")] = None,
    kv_buckets: Annotated[Optional[str], typer.Option("--kv-buckets", help="A language model with a key/value cache (past_key_values.* in, present.* out): the past lengths to compile for, e.g. 256,1024; with --prefill-chunks, one specialization per new-token count (1, each chunk) and bucket, for `cortex generate`. --max-cu-depth and --max-cu-size left at their defaults become 40 and 50000000 (about a CU per layer).")] = None,
    prefill_chunks: Annotated[str, typer.Option("--prefill-chunks", help="With --kv-buckets: the prompt chunk lengths prefill runs, e.g. 64,8 (the largest also keys the prefix cache).")] = "64,8",
    cache_inputs_from: Annotated[Optional[Path], typer.Option("--cache-inputs-from", help="Calibration feeds (a folder of .npz files, one feed each, or one .npz whose arrays stack the feeds on a first axis): an input whose value is the same in every feed is added to --cache-inputs.")] = None,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Partition a model into computation units (CUs), each a self-contained ONNX model."""
    calibration = read_feeds(cache_inputs_from) if cache_inputs_from is not None else None
    specializations = parse_specializations(input_shape, dim)
    if kv_buckets is not None:
        if specializations is not None:
            raise CortexError("--kv-buckets makes the specializations itself: give --input-shape and --dim one value each")
        specializations = generation_specializations(model_path, _lengths("--kv-buckets", kv_buckets),
                                                     _lengths("--prefill-chunks", prefill_chunks), parse_dims(dim))
        defaults = PartitionIntoCUs()
        limits = replace(limits, **{name: value for name, value in GENERATION_LIMITS.items()
                                    if getattr(limits, name) == getattr(defaults, name)})
    frozen = read_frozen_inputs(freeze_input or [])
    if specialize:
        specializations = value_specializations(model_path, specialize, frozen, specializations or [
            Specialization("", parse_input_shapes(input_shape), parse_dims(dim))])
    if specializations is not None:
        summary = decompose_specializations(model_path, output_dir, limits, specializations,
                                            frozen_inputs=frozen, calibration_feeds=calibration)
        if json:
            print_json(summary)
        else:
            for name, one in summary["specializations"].items():
                out.print(f"{name}: {one['cus']} CUs, {one['params']['total']:,} params in {one['output_dir']}")
        return
    summary = decompose_model(model_path, output_dir, limits, input_shapes=parse_input_shapes(input_shape),
                              dims=parse_dims(dim), frozen_inputs=frozen,
                              calibration_feeds=calibration, show_progress=not json)
    if json:
        print_json(summary)
    else:
        _print_summary(summary)


def _lengths(flag: str, text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise CortexError(f"bad {flag} {text!r}: expected comma-separated lengths, e.g. 256,1024")
    return [int(p) for p in parts]


def decompose_model(model_path: Path, output_dir: Path, limits: PartitionIntoCUs | None = None, *,
                    input_shapes: dict | None = None, dims: dict | None = None,
                    frozen_inputs: dict | None = None, calibration_feeds: list[dict] | None = None,
                    show_progress: bool = False, graph_passes: tuple = ()) -> dict:
    """Optimise, fuse and partition the model under `limits` (a PartitionIntoCUs pass, whose fields
    are decompose's options) and write the CU folder; returns the summary. The model inputs whose
    value is the same in every one of `calibration_feeds` join `limits.cache_inputs`."""
    limits = limits or PartitionIntoCUs()
    if limits.fallback is not None:
        limits = replace(limits, cannot_lower=unsupported_nodes)   # the rule compile-<target> applies to each CU
    input_shapes, dims = input_shapes or {}, dims or {}
    check_output_dir(Path(output_dir), Path(model_path))
    start = time.perf_counter()
    with _progress(show_progress) as step:
        step("optimising")
        optimized = load_and_optimize(model_path, input_shapes, dims, require_static=True,
                                      frozen_inputs=frozen_inputs)
        if calibration_feeds is not None:
            model_inputs = {v.name for v in optimized.graph.inputs}
            found = [name for name in repeating_inputs(calibration_feeds) if name in model_inputs]
            limits = replace(limits, cache_inputs=tuple(dict.fromkeys([*limits.cache_inputs, *found])))
        step("fusing and partitioning")
        graph, _ = run_pipeline(optimized.graph, [*graph_passes, FuseGroups()])
        partition = limits.run(graph)
        options = {**limits.limits(),
                   "input_shapes": {k: list(v) for k, v in sorted(input_shapes.items())},
                   "dims": dict(sorted(dims.items()))}
        if frozen_inputs:
            options["frozen_inputs"] = frozen_summary(frozen_inputs)
        step("writing CUs", total=len(partition.cus))
        manifest = write_cus(graph, partition, Path(output_dir), model_info(Path(model_path), graph), options,
                             on_cu=lambda i: step(advance=1))
    return summarize(manifest, partition, output_dir, time.perf_counter() - start)


def decompose_specializations(model_path: Path, output_dir: Path, limits: PartitionIntoCUs | None,
                              specializations: list[Specialization], **options) -> dict:
    """One CU folder per specialization under `output_dir` (replaced as a whole), listed in
    specializations.json; each is decomposed exactly as a plain build of that shape."""
    check_output_dir(Path(output_dir), Path(model_path))
    start = time.perf_counter()

    def fill(folder: Path) -> dict:
        summaries = {}
        for spec in specializations:
            frozen = {**(options.get("frozen_inputs") or {}), **spec.input_values}
            one = decompose_model(model_path, folder / spec.folder, limits,
                                  input_shapes=spec.input_shapes, dims=spec.dims, graph_passes=spec.graph_passes,
                                  **{**options, "frozen_inputs": frozen or None})
            summaries[spec.name] = {**one, "output_dir": str(Path(output_dir) / spec.folder)}
        share_cu_weights(folder, [spec.folder for spec in specializations])
        (folder / LISTING).write_text(jsonlib.dumps(listing_document(specializations), indent=2) + "\n")
        return summaries

    summaries = write_directory_atomically(Path(output_dir), fill)
    return {"output_dir": str(output_dir), "specializations": summaries,
            "cus": sum(s["cus"] for s in summaries.values()), "seconds": round(time.perf_counter() - start, 3)}


def value_specializations(model_path: Path, items: list[str], frozen: dict,
                          specializations: list[Specialization]) -> list[Specialization]:
    """`specializations` (the shape ones, or the one plain build) once per value --specialize
    gives (cortex/value_specializations.py), each to be built with its input frozen to its value."""
    parsed = parse_specialize(items)
    both = sorted(set(parsed) & set(frozen))
    if both:
        raise CortexError(f"--specialize {both[0]} and --freeze-input {both[0]}: an input is either frozen to one "
                          "value or specialised for several")
    graph = load_model(model_path)
    return with_values(specializations, lambda spec: value_rows(parsed, graph, spec.input_shapes))


def read_frozen_inputs(items: list[str]) -> dict:
    """--freeze-input reads its files exactly as `cortex run --input` does; its errors name this flag."""
    try:
        return read_inputs(items)
    except CortexError as e:
        raise CortexError(str(e).replace("--input", "--freeze-input", 1)) from None


def read_feeds(path: Path) -> list[dict[str, np.ndarray]]:
    """The calibration feeds of --cache-inputs-from."""
    label = f"--cache-inputs-from {path}"
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        feeds = [_npz(f, label) for f in files]
    elif path.is_file():
        stacked = _npz(path, label)
        counts = {len(v) if v.ndim else 0 for v in stacked.values()}
        if len(counts) != 1 or 0 in counts:
            raise CortexError(f"{label}: every array must stack the same number of feeds on its first axis")
        feeds = [{name: v[i] for name, v in stacked.items()} for i in range(counts.pop())]
    else:
        raise CortexError(f"{label}: no such file or folder")
    if len(feeds) < 2:
        raise CortexError(f"{label}: holds {len(feeds)} feed(s); at least 2 are needed to see which inputs repeat")
    return feeds


def _npz(path: Path, label: str) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise CortexError(f"{label}: {path} is not a readable .npz file ({e})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise CortexError(f"{label}: {path} is a single array; feeds are named, so give an .npz file "
                          "(or a folder of them)")
    with loaded:
        return {k: loaded[k] for k in loaded.files}


def repeating_inputs(feeds: list[dict[str, np.ndarray]]) -> list[str]:
    """The inputs that every feed gives, with the same dtype, shape and bytes."""
    first = feeds[0]
    return [name for name, v in first.items()
            if all(name in f and f[name].dtype == v.dtype and f[name].shape == v.shape
                   and np.ascontiguousarray(f[name]).tobytes() == np.ascontiguousarray(v).tobytes()
                   for f in feeds[1:])]


def summarize(manifest: dict, partition: Partition, output_dir: Path, seconds: float) -> dict:
    params = [cu["params"] for cu in manifest["cus"]]
    producer = {t: cu["id"] for cu in manifest["cus"] for t in cu["outputs"]}
    crossing = sum(manifest["tensors"][t]["bytes"] for cu in manifest["cus"] for t in cu["inputs"] if t in producer)
    small = {}
    for cu_entry, cu in zip(manifest["cus"], partition.cus):
        if cu.small_reason:
            small.setdefault(cu.small_reason, []).append(cu_entry["id"])
    return {
        "output_dir": str(output_dir),
        "cus": len(params),
        "nodes": sum(len(cu["nodes"]) for cu in manifest["cus"]),
        "fusion_groups": sum(len(cu["fusion_groups"]) for cu in manifest["cus"]),
        "split_ops": partition.split_ops,
        "sliced_ops": partition.sliced_ops,
        "params": {"total": sum(params), "min": min(params, default=0),
                   "median": statistics.median(params) if params else 0, "max": max(params, default=0)},
        "max_depth": max((cu["depth"] for cu in manifest["cus"]), default=0),
        "bytes_crossing_borders": crossing,
        "small_cus": {reason: ids for reason, ids in sorted(small.items())},
        "over_limit_cus": {cu["id"]: {"params": cu["params"], "reason": cu["over_limit"]}
                           for cu in manifest["cus"] if "over_limit" in cu},
        "branch_cus": {cu["id"]: cu["activation"] for cu in manifest["cus"] if "activation" in cu},
        "selects": len(manifest.get("selects", [])),
        "cache_inputs": manifest["options"].get("cache_inputs", []),
        "repeating_cus": [cu["id"] for cu in manifest["cus"] if cu.get("cache") == "repeating"],
        "fallback_cus": {runtime: [cu["id"] for cu in manifest["cus"] if cu.get("runs_on") == runtime]
                         for runtime in sorted({cu["runs_on"] for cu in manifest["cus"] if "runs_on" in cu})},
        "seconds": round(seconds, 3),
    }


@contextmanager
def _progress(enabled: bool):
    """A progress bar on stdout when it is a terminal; `step(description, total=..)` starts a step,
    `step(advance=n)` moves it."""
    if not enabled or not out.is_terminal:
        yield lambda *args, **kwargs: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=out,
                  transient=True) as progress:
        current = {}

        def step(description: str | None = None, total: int | None = None, advance: int = 0):
            if description is not None:
                if "task" in current:
                    progress.update(current["task"], completed=progress.tasks[current["task"]].total or 1)
                current["task"] = progress.add_task(description, total=total or 1)
            elif advance:
                progress.advance(current["task"], advance)
        yield step


def _print_summary(summary: dict) -> None:
    p = summary["params"]
    print_summary(f"Decomposed into {summary['output_dir']}", [
        ("CUs", str(summary["cus"])),
        ("nodes / fusion groups", f"{summary['nodes']} / {summary['fusion_groups']}"),
        ("ops split to fit --max-cu-size", str(summary["split_ops"])),
        *([("ops sliced for --parallel", str(summary["sliced_ops"]))] if summary["sliced_ops"] else []),
        ("params min / median / max", f"{p['min']:,} / {p['median']:,.0f} / {p['max']:,}"),
        ("params total", f"{p['total']:,}"),
        ("max depth", str(summary["max_depth"])),
        ("bytes crossing CU borders", f"{summary['bytes_crossing_borders']:,}"),
        ("time", f"{summary['seconds']:.2f} s"),
    ])
    for reason, ids in summary["small_cus"].items():
        out.print(f"{len(ids)} CU(s) stayed under --min-cu-size: {reason}: {_shown(ids)}")
    for cu, over in summary["over_limit_cus"].items():
        out.print(f"{cu} holds {over['params']:,} parameters, over --max-cu-size: {over['reason']}")
    if summary["branch_cus"]:
        out.print(f"{len(summary['branch_cus'])} branch CU(s) run only when their If takes their branch "
                  f"({summary['selects']} If output(s) selected at run time): {_shown(list(summary['branch_cus']))}")
    if summary["repeating_cus"]:
        ids = summary["repeating_cus"]
        out.print(f"{len(ids)} CU(s) depend only on --cache-inputs {','.join(summary['cache_inputs'])}: {_shown(ids)}")
    for runtime, ids in summary["fallback_cus"].items():
        out.print(f"{len(ids)} fallback CU(s) run on {runtime} (nodes no target lowers): {_shown(ids)}")


def _shown(ids: list[str]) -> str:
    return ", ".join(ids[:8]) + (f" ... ({len(ids)} in all)" if len(ids) > 8 else "")
