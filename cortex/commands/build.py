"""`cortex build MODEL --output OUT --targets wasm,cuda`: decompose, build-dag and compile-<target>
for each target in one command, into `OUT/cus`, `OUT/dag.json` and `OUT/<target>-bin`, plus the
build record `OUT/build.json` (`cortex.build_record`); `--check` compares OUT with that record and
writes nothing.

Its options are not written here: they are the options of the commands it runs, read from their
signatures, so an option added to one of them is an option of `cortex build` too. Those of
decompose and build-dag keep their names; those of compile-<target> are prefixed with the target,
since targets share option names (`--wasm-features`, `--wasm-opt-level`, `--cuda-arch`,
`--cuda-variants`). The compile cache's options are build's own and apply to every target.

Each stage is the command itself, run with `--json` (its summary is read back), into a staging
folder beside OUT; only when every stage succeeded are OUT's entries replaced by the new ones, so a
failed build leaves OUT as it was, and files of others in OUT are kept. The artifacts are those
the four commands write, byte for byte, when they are given the same model path and the folders
above (with a model inside OUT, dag.json's `source_model` path takes a detour through OUT's parent).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import io
import json as jsonlib
import os
import re
import shutil
import tempfile
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable

import typer

from backends.registry import targets as registered_targets
from cortex.build_record import (
    RECORD_FILE,
    StaleBuild,
    artifact_hashes,
    files_named_by,
    first_difference,
    read_record,
    write_record,
)
from cortex.commands import build_dag, decompose
from cortex.commands.cache_options import (
    CACHE_PARAMETERS,
    CacheDir,
    CacheMaxMb,
    NoCache,
    open_cache,
)
from cortex.commands.compile_target import compile_command
from cortex.compile import check_variants, parse_variants
from cortex.compile_cache import DEFAULT_MAX_MB, compiler_version
from cortex.console import print_json, print_summary
from cortex.cus import check_output_dir
from ir.errors import CortexError
from ir.fs import current_umask, file_sha256
from ir.options import from_text, option_fields

CU_FOLDER, DAG_FILE = "cus", "dag.json"


@dataclass
class Stage:
    name: str                    # "decompose", "build-dag" or a target's name
    command: Callable
    parameters: dict[str, str]   # build's parameter name -> the command's
    flags: dict[str, str]        # the command's parameter name -> build's flag
    own_flags: dict[str, str]    # the command's parameter name -> the command's flag


def _stage(name: str, command: Callable, set_by_build: set[str], prefix: str = "") -> tuple[Stage, list]:
    """The stage, and the parameters build takes for it: the command's, less those build sets."""
    stage, params = Stage(name, command, {}, {}, {}), []
    for p in inspect.signature(command, eval_str=True).parameters.values():
        if p.name in set_by_build:
            continue
        kind, info = typing.get_args(p.annotation)[:2]
        mine = f"{prefix.replace('-', '_')}_{p.name}" if prefix else p.name
        stage.own_flags[p.name] = _flag(info, p.name)
        if prefix:
            info = _prefixed(info, prefix)
        stage.parameters[mine] = p.name
        stage.flags[p.name] = _flag(info, mine)
        params.append(p.replace(name=mine, annotation=Annotated[kind, info]))
    return stage, params


def _flag(info, name: str) -> str:
    """The option's first flag, as typer derives it (`Option("--x")` keeps "--x" as its default)."""
    decls = [info.default] if isinstance(info.default, str) and info.default.startswith("-") else []
    return ([*decls, *info.param_decls] or ["--" + name.replace("_", "-")])[0].split("/")[0]


def _prefixed(info, prefix: str):
    """The typer option under `--<prefix>-<flag>` (a flag pair such as `--a/--no-a` keeps its shape)."""
    def rename(decl):
        if not isinstance(decl, str) or not decl.startswith("--"):
            return decl
        return "/".join(f"--{prefix}-{part[2:]}" for part in decl.split("/"))
    renamed = copy.copy(info)
    renamed.default = rename(info.default)
    renamed.param_decls = tuple(rename(d) for d in info.param_decls)
    return renamed


def _stages() -> tuple[list[Stage], list]:
    found = [_stage("decompose", decompose.decompose, {"model_path", "output_dir", "json"}),
             _stage("build-dag", build_dag.build_dag, {"cu_dir", "output", "format", "json"})]
    for target in registered_targets().values():
        found.append(_stage(target.name, compile_command(target),
                            {"cu_dir", "output", "dag", "json", *CACHE_PARAMETERS}, prefix=target.name))
    return [s for s, _ in found], [p for _, params in found for p in params]


def build(
    model: Annotated[Path, typer.Argument(help="The ONNX model file.")],
    output: Annotated[Path, typer.Option("--output", help=f"Folder for {CU_FOLDER}/, {DAG_FILE}, <target>-bin/ and "
                                         f"{RECORD_FILE} (those entries are replaced; other files stay).")],
    targets: Annotated[str, typer.Option("--targets", help="Comma-separated targets to compile for.")] = "wasm",
    check: Annotated[bool, typer.Option("--check", help="Write nothing: exit 0 when --output is up to date for "
                                        "this model and these options, 1 with the reason when not.")] = False,
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
    cache_dir: CacheDir = None,
    cache_max_mb: CacheMaxMb = DEFAULT_MAX_MB,
    no_cache: NoCache = False,
    **stage_values,
) -> None:
    """Decompose, build the CU graph and compile for every target in one command (incremental)."""
    chosen = _parse_targets(targets)
    values = {s.name: {s.parameters[k]: v for k, v in stage_values.items() if k in s.parameters} for s in STAGES}
    run = [s for s in STAGES if s.name in ("decompose", "build-dag", *chosen)]
    _check_variants(run, values)
    wanted = _wanted_record(model, chosen, run, values)
    if check:
        _check(output, wanted, run, json)
        return
    summary = _build(model, output, chosen, run, values, wanted, open_cache(cache_dir, cache_max_mb, no_cache))
    if json:
        print_json(summary)
        return
    rows = [("CUs", str(summary["cus"]))]
    for name, compiled in summary["compile"].items():
        rows.append((f"{name}: compiled / reused CUs", f"{compiled['compiled_cus']} / {compiled['reused_cus']}"))
        rows.append((f"{name}: bytes", f"{compiled.get('bytes', 0):,}"))
    rows += [("build record", str(output / RECORD_FILE)), ("time", f"{summary['seconds']:.2f} s")]
    print_summary(f"Built {model} into {output}", rows)


def _parse_targets(text: str) -> list[str]:
    known = registered_targets()
    chosen = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in chosen if t not in known]
    if unknown or not chosen:
        raise CortexError(f"--targets {text!r}: expected a comma-separated subset of {','.join(known)}")
    return chosen


def _check_variants(run: list[Stage], values: dict) -> None:
    """Each target's `--<target>-variants` checked before any stage runs: a precision only another
    target builds (`--wasm-variants tf32`), or one its options exclude (`--cuda-variants tf32
    --cuda-arch sm_75`), fails at once, not after decompose."""
    known = registered_targets()
    for stage in run:
        target, given = known.get(stage.name), values[stage.name]
        if target is not None and given.get("variants"):
            with _in_build_terms(stage):
                variants = parse_variants(given["variants"], target)
                check_variants(target, from_text(target.options, **_fields(target.options, given)), variants)


def _wanted_record(model: Path, chosen: list[str], run: list[Stage], values: dict) -> dict:
    """The build record this build would write, less its artifacts."""
    if not model.is_file():
        raise CortexError(f"model {model}: no such file")
    options = {s.name: _resolved(s, values[s.name]) for s in run}
    named = {}
    for s in run:
        named.update(files_named_by(options[s.name]))
    known = registered_targets()
    return {"model": {"path": str(model), "sha256": file_sha256(model)}, "targets": chosen,
            "options": options, "option_files": named, "compiler": compiler_version(),
            "toolchains": {t: known[t].toolchain(from_text(known[t].options, **_fields(known[t].options,
                                                                                       values[t])))
                           for t in chosen}}


def _fields(cls, given: dict) -> dict:
    return {f.name: given[f.name] for f, _ in option_fields(cls) if f.name in given}


def _resolved(stage: Stage, given: dict) -> dict:
    """A stage's options as JSON, those of an options class as it parsed them (`--features
    simd,bulk-memory` and `bulk-memory,simd` are one build)."""
    resolved = {name: _as_json(value) for name, value in given.items()}
    with _in_build_terms(stage):
        for cls in getattr(stage.command, "option_classes", ()):
            parsed = from_text(cls, **_fields(cls, given))
            resolved.update({f.name: _as_json(getattr(parsed, f.name)) for f, _ in option_fields(cls)})
            # What parsing sets besides the option fields (--wasm-features' alternate sets), when set.
            resolved.update({f.name: _as_json(getattr(parsed, f.name)) for f in dataclasses.fields(parsed)
                             if f.name not in resolved and f.default is not dataclasses.MISSING
                             and getattr(parsed, f.name) != f.default})
    return resolved


@contextlib.contextmanager
def _in_build_terms(stage: Stage):
    """A stage's errors name its options as build spells them (`--wasm-opt-level`, not `--opt-level`)."""
    try:
        yield
    except CortexError as e:
        message = str(e)
        for name, flag in stage.flags.items():
            own = stage.own_flags[name]
            if own != flag:
                message = re.sub(rf"(?<![\w-]){re.escape(own)}(?![\w-])", flag, message)
        raise type(e)(message) from None


def _as_json(value):
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _check(output: Path, wanted: dict, run: list[Stage], as_json: bool) -> None:
    flags = {(s.name, name): flag for s in run for name, flag in s.flags.items()}
    try:
        reason = first_difference(output, read_record(output), wanted, flags)
    except StaleBuild as e:
        reason = str(e)
    if as_json:
        print_json({"output": str(output), "up_to_date": reason is None, "reason": reason})
        if reason is not None:
            raise typer.Exit(1)
    elif reason is not None:
        raise StaleBuild(f"{output} is not up to date: {reason}")
    else:
        print(f"{output} is up to date")


def _build(model: Path, output: Path, chosen: list[str], run: list[Stage], values: dict, wanted: dict,
           cache) -> dict:
    start = time.perf_counter()
    if output.exists() and not output.is_dir():
        raise CortexError(f"--output {output} exists and is not a folder")
    check_output_dir(output / CU_FOLDER, model)
    parent = output.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.resolve().name}.", suffix=".build", dir=parent))
    try:
        os.chmod(staging, 0o777 & ~current_umask())
        by_name = {s.name: s for s in run}
        with _named_as(staging, output):
            summaries = {"decompose": _quietly(by_name["decompose"], model_path=model,
                                               output_dir=staging / CU_FOLDER, **values["decompose"]),
                         "build-dag": _quietly(by_name["build-dag"], cu_dir=staging / CU_FOLDER,
                                               output=staging / DAG_FILE, format="json", **values["build-dag"])}
            cache_options = {"cache_dir": cache.folder if cache else None, "no_cache": cache is None,
                             "cache_max_mb": cache.max_bytes / 2**20 if cache else DEFAULT_MAX_MB}
            compiled = {name: _quietly(by_name[name], cu_dir=staging / CU_FOLDER, output=staging / f"{name}-bin",
                                       dag=staging / DAG_FILE, **cache_options, **values[name])
                        for name in chosen}
        entries = [CU_FOLDER, DAG_FILE, *(f"{name}-bin" for name in chosen)]
        write_record(staging / RECORD_FILE, {**wanted, "artifacts": artifact_hashes(staging, entries)})
        _swap_in(staging, output, entries, _earlier_entries(output))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    summaries, compiled = _named_in_output({"stages": summaries, "compiled": compiled}, staging, output).values()
    return {"output": str(output), "model": str(model), "targets": chosen,
            "cus": summaries["decompose"]["cus"], "decompose": summaries["decompose"],
            "build_dag": summaries["build-dag"], "compile": compiled,
            "compiled_cus": sum(c["compiled_cus"] for c in compiled.values()),
            "reused_cus": sum(c["reused_cus"] for c in compiled.values()),
            "cache_dir": str(cache.folder) if cache else None, "record": str(output / RECORD_FILE),
            "seconds": round(time.perf_counter() - start, 3)}


def _named_in_output(summary: dict, staging: Path, output: Path) -> dict:
    """The stages' summaries with the paths they wrote to as they are now, in the output folder."""
    text = jsonlib.dumps(summary)
    for path in (str(staging.resolve()), str(staging)):
        text = text.replace(jsonlib.dumps(path)[1:-1], jsonlib.dumps(str(output))[1:-1])
    return jsonlib.loads(text)


def _quietly(stage: Stage, **kwargs) -> dict:
    """Run a stage's command with --json and return the summary it printed."""
    printed = io.StringIO()
    with _in_build_terms(stage), contextlib.redirect_stdout(printed):
        stage.command(**kwargs, json=True)
    return jsonlib.loads(printed.getvalue())


@contextlib.contextmanager
def _named_as(staging: Path, output: Path):
    """Errors name the output folder, not the staging folder the stages write into."""
    try:
        yield
    except CortexError as e:
        message = str(e)
        for path in (str(staging.resolve()), str(staging)):
            message = message.replace(path, str(output))
        raise type(e)(message) from None


def _earlier_entries(output: Path) -> list[str]:
    """The target folders an earlier build recorded: replaced, or removed when not built again."""
    try:
        record = read_record(output)
    except StaleBuild:
        return []
    return [f"{t}-bin" for t in record.get("targets", []) if isinstance(t, str) and "/" not in t]


def _swap_in(staging: Path, output: Path, entries: list[str], earlier: list[str]) -> None:
    """Move the staged entries into `output`; on a failure part way, put the earlier ones back."""
    output.mkdir(parents=True, exist_ok=True)
    previous = staging / ".previous"
    previous.mkdir()
    moved, placed = [], []
    try:
        for name in dict.fromkeys([RECORD_FILE, *entries, *earlier]):   # the record first: no record, stale
            if (output / name).exists():
                os.replace(output / name, previous / name)
                moved.append(name)
        for name in [*entries, RECORD_FILE]:
            os.replace(staging / name, output / name)
            placed.append(name)
    except BaseException:
        for name in placed:
            target = output / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        for name in moved:
            os.replace(previous / name, output / name)
        raise


STAGES, _STAGE_PARAMETERS = _stages()
_OWN = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(build, eval_str=True).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD]
_clash = {p.name for p in _OWN} & {p.name for p in _STAGE_PARAMETERS}
assert not _clash, f"cortex build's own options collide with its stages': {_clash}"
build.__signature__ = inspect.Signature(_OWN + _STAGE_PARAMETERS)
build.__annotations__ = {p.name: p.annotation for p in build.__signature__.parameters.values()}
