"""`build.json` (`cortex.build/1`): what `cortex build` built an output folder from, so that
`cortex build --check` can tell, without building, whether the folder is still what a build would
write: the model (path and sha256), the resolved options of every stage, the files those options
name (`--freeze-input x=x.npy`), the compiler's version, the external toolchains, and the sha256
of every file written.

The check compares in that order and stops at the first difference, which it names in one line.
Files the runtimes add beside the artifacts later (wasmtime's native-code cache) are not part of
the record and do not make a folder stale. The record's JSON Schema is
`cortex/schemas/build.schema.json` (its fields are described there and in docs/build-record.md); a record
that does not follow it is stale, named with the field at fault.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema

from ir.errors import CortexError
from ir.fs import file_sha256, write_bytes_atomically

BUILD_SCHEMA = "cortex.build/1"
RECORD_FILE = "build.json"
SCHEMA_FILE = Path(__file__).resolve().parent / "schemas" / "build.schema.json"


class StaleBuild(CortexError):
    """The output folder is not what this build would write: a failed check (exit code 1)."""

    exit_code = 1


def artifact_hashes(folder: Path, names: list[str]) -> dict[str, str]:
    """sha256 of every file under `folder` that the entries `names` (files or folders) hold, by
    path relative to `folder`."""
    hashes = {}
    for name in names:
        path = folder / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            hashes[file.relative_to(folder).as_posix()] = file_sha256(file)
    return hashes


def files_named_by(values: dict) -> dict[str, str]:
    """sha256 of each file (or folder) an option value names, as `PATH` or `NAME=PATH`: a build
    depends on their contents, not only on the option's text."""
    named = {}
    for value in values.values():
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str) or not item:
                continue
            path = Path(item.rpartition("=")[2])
            if path.is_file():
                named[item] = file_sha256(path)
            elif path.is_dir():
                named[item] = json.dumps(artifact_hashes(path, ["."]), sort_keys=True)
    return named


def write_record(path: Path, record: dict) -> None:
    write_bytes_atomically(path, (json.dumps({"schema": BUILD_SCHEMA, **record}, indent=2) + "\n").encode())


def read_record(folder: Path) -> dict:
    path = folder / RECORD_FILE
    if not path.is_file():
        raise StaleBuild(f"{folder} has no {RECORD_FILE}: it was not written by 'cortex build' (or not yet)")
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StaleBuild(f"{path}: not a readable build record ({e})") from None
    if not isinstance(record, dict) or record.get("schema") != BUILD_SCHEMA:
        raise StaleBuild(f"{path}: not a {BUILD_SCHEMA} record")
    error = jsonschema.exceptions.best_match(_validator().iter_errors(record))
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        raise StaleBuild(f"{path}: does not follow the {BUILD_SCHEMA} schema at {where or 'the top'}: "
                         f"{error.message[:160]}")
    return record


def build_schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())


@cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(build_schema())


def first_difference(folder: Path, built: dict, wanted: dict, flags: dict[tuple[str, str], str]) -> str | None:
    """Why the build recorded as `built` in `folder` is not the one `wanted` describes (a record
    without artifacts), or None when it is. `flags` names each (stage, option) as the CLI spells it."""
    try:
        if built["model"]["sha256"] != wanted["model"]["sha256"]:
            return (f"the model {wanted['model']['path']} changed since the build (sha256 "
                    f"{wanted['model']['sha256'][:12]}..., built from {built['model']['sha256'][:12]}...)")
        if built["model"]["path"] != wanted["model"]["path"]:
            return f"built from the model {built['model']['path']}, not {wanted['model']['path']}"
        if built["targets"] != wanted["targets"]:
            return f"built for --targets {','.join(built['targets'])}, not {','.join(wanted['targets'])}"
        for stage, options in wanted["options"].items():
            before = built["options"].get(stage, {})
            for name, value in options.items():
                if name not in before or before[name] != value:
                    old = _shown(before[name]) if name in before else "(no such option then)"
                    return (f"option {flags.get((stage, name), name)} changed: built with {old}, "
                            f"now {_shown(value)}")
        for item, digest in wanted["option_files"].items():
            if built["option_files"].get(item) != digest:
                return f"the file named by {item} changed since the build"
        if built["compiler"] != wanted["compiler"]:
            return f"built by Cortex {built['compiler']}, this is {wanted['compiler']}"
        for target, toolchain in wanted["toolchains"].items():
            if built["toolchains"].get(target) != toolchain:
                return f"the {target} toolchain changed: built with {built['toolchains'].get(target)}, now {toolchain}"
        for name, digest in built["artifacts"].items():
            path = folder / name
            if not path.is_file():
                return f"{path} is missing"
            if file_sha256(path) != digest:
                return f"{path} was changed since the build (its sha256 is not the recorded one)"
    except (KeyError, TypeError, AttributeError) as e:
        return f"{folder / RECORD_FILE} is incomplete ({type(e).__name__}: {e})"
    return None


def _shown(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return "none" if value is None else str(value)
