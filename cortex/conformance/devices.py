"""The devices the harness can target, and how a CU folder is compiled for each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ir.errors import CortexError

DEVICES = ("wasm", "cuda-sim")
_COMPILE_COMMAND = {"wasm": "compile-wasm", "cuda-sim": "compile-cuda"}


def unavailable_reason(device: str) -> str | None:
    """None when the device can be compiled for and run here; otherwise why not, in one line."""
    if device not in DEVICES:
        return f"unknown device {device!r}: expected one of {', '.join(DEVICES)}"
    from cortex.cli import app
    from cortex.runtime import DEVICES as RUNTIME_DEVICES

    commands = {c.name for c in app.registered_commands}
    missing = [f"'cortex {_COMPILE_COMMAND[device]}'"] if _COMPILE_COMMAND[device] not in commands else []
    if device not in RUNTIME_DEVICES:
        missing.append(f"cortex.load(..., device={device!r})")
    return f"{' and '.join(missing)} not available yet" if missing else None


def compile_for_device(device: str, cu_dir: Path, dag_path: Path, out: Path) -> None:
    if device == "wasm":
        # In-process: the same function `cortex compile-wasm` calls, with its default options.
        from backends.wasm.build import compile_cu_dir
        from backends.wasm.options import parse_options
        compile_cu_dir(cu_dir, out / "wasm-bin", parse_options(None, None, None), dag_path)
        return
    # Other devices go through their command line, whose options the harness does not second-guess.
    command = [sys.executable, "-m", "cortex.cli", _COMPILE_COMMAND[device], "--cu-dir", str(cu_dir),
               "--dag", str(dag_path), "--output", str(out / f"{device}-bin")]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 2:
        raise CortexError(done.stderr.strip().removeprefix("error: "))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[3:4])} exited {done.returncode}: {done.stderr.strip()[-300:]}")
