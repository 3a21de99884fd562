"""Running the installed `cortex` console script from tests, and what a user-mistake error must
look like. Always a subprocess of the real entry point: exit codes and signals are part of the
command's contract, and an in-process runner can hide what reaches the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# The script pip installed next to the interpreter running the tests (.venv/bin/cortex).
CORTEX = Path(sys.executable).with_name("cortex")
TIMEOUT_S = 900


def cortex_command(*argv) -> list[str]:
    assert CORTEX.is_file(), f"{CORTEX} is not installed; run 'make setup'"
    return [str(CORTEX), *map(str, argv)]


def run_cli(argv: list, env: dict | None = None, cwd: Path | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cortex ARGV`."""
    result = subprocess.run(cortex_command(*argv), capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**os.environ, **(env or {})}, cwd=cwd)
    return result.returncode, result.stdout, result.stderr


def assert_one_line_error(code: int, err: str, *fragments: str, exit_code: int = 2) -> None:
    """The exit code, one `error: ...` line on stderr holding every fragment, no traceback."""
    assert code == exit_code, f"exit code {code}, stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def build_and_run(model: Path, folder: Path, feeds: dict, *decompose_flags) -> dict:
    """`cortex decompose` (with `decompose_flags`), `build-dag`, `compile-wasm` and `run` of `model`
    on `feeds`, each asserted to succeed: the outputs by name."""
    np.savez(folder / "feeds.npz", **feeds)
    for argv in (["decompose", "--model-path", model, "--output-dir", folder / "cus", *decompose_flags],
                 ["build-dag", "--cu-dir", folder / "cus", "--output", folder / "dag.json"],
                 ["compile-wasm", "--cu-dir", folder / "cus", "--output", folder / "wasm", "--dag", folder / "dag.json"],
                 ["run", folder / "dag.json", "--input", folder / "feeds.npz", "--output", folder / "out.npz"]):
        code, _, err = run_cli(argv)
        assert code == 0, f"{argv[0]}: {err}"
    with np.load(folder / "out.npz") as got:
        return dict(got)


def first_failure(model: Path, folder: Path, *decompose_flags) -> tuple[str, int, str]:
    """The first of `cortex decompose`, `build-dag` and `compile-wasm` on `model` that fails: (its
    command, exit code, stderr); asserts that one does."""
    for argv in (["decompose", "--model-path", model, "--output-dir", folder / "cus", *decompose_flags],
                 ["build-dag", "--cu-dir", folder / "cus", "--output", folder / "dag.json"],
                 ["compile-wasm", "--cu-dir", folder / "cus", "--output", folder / "wasm", "--dag", folder / "dag.json"]):
        code, _, err = run_cli(argv)
        if code != 0:
            return argv[0], code, err
    raise AssertionError(f"{model} compiled, expected a failure")
