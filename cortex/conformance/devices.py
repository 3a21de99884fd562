"""The devices the harness can target, and how a CU folder is compiled for each."""

from __future__ import annotations

from pathlib import Path

from ir.errors import CortexError

DEVICES = ("wasm", "cuda-sim", "cuda")
_COMPILE_COMMAND = {"wasm": "compile-wasm", "cuda-sim": "compile-cuda", "cuda": "compile-cuda"}


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
    if missing:
        return f"{' and '.join(missing)} not available yet"
    if device == "cuda":
        from backends.cuda.compile import choose_compiler
        from backends.cuda.device import open_driver
        try:
            open_driver()           # this process only; each case runs in a fresh one
            choose_compiler("auto")
        except CortexError as e:
            return str(e)
    return None


def compile_for_device(device: str, cu_dir: Path, dag_path: Path, out: Path) -> None:
    """In-process: the functions `cortex compile-wasm` and `cortex compile-cuda` call, with their
    default options, except that cuda-sim builds its PTX and cubins with NVRTC: the simulator runs
    the .cu source itself, and NVRTC in-process is about a second and a half faster per case than nvcc.
    `cuda` (a GPU) uses compile-cuda's default compiler, as a user would."""
    if device == "wasm":
        from backends.wasm.build import compile_cu_dir
        from backends.wasm.options import parse_options
        compile_cu_dir(cu_dir, out / "wasm-bin", parse_options(None, None, None), dag_path)
    elif device in ("cuda-sim", "cuda"):
        from backends.cuda.build import compile_cu_dir
        from backends.cuda.compile import DEFAULT_ARCHS
        compile_cu_dir(cu_dir, out / "cuda-bin", DEFAULT_ARCHS, "nvrtc" if device == "cuda-sim" else "auto",
                       dag_path, jobs=1)
    else:
        raise CortexError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
