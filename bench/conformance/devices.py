"""The devices the harness can target (every registered device) and how a CU folder is compiled
for each: with the default options of the device's target, plus what the device asks for
(`DeviceSpec.compile_options`: cuda-sim builds with NVRTC, which in process is about a second and
a half faster per case than nvcc, since the simulator runs the .cu source itself)."""

from __future__ import annotations

from pathlib import Path

from backends.registry import devices, targets
from cortex.compile import compile_cu_dir
from ir.errors import CortexError
from ir.options import from_text


def device_names() -> list[str]:
    return list(devices())


def unavailable_reason(device: str) -> str | None:
    """None when the device can be compiled for and run here; otherwise why not, in one line."""
    known = devices()
    if device not in known:
        return f"unknown device {device!r}: expected one of {', '.join(known)}"
    reason = known[device].unavailable()
    if reason or _target_of(device) is None:
        return reason
    try:
        _target_of(device).check(_options(device))
    except CortexError as e:
        return str(e)
    return None


def compile_for_device(device: str, cu_dir: Path, dag_path: Path, out: Path) -> None:
    """In process, what `cortex compile-<target>` does, into `out/<target>-bin` (nothing for a
    device that runs the CUs' ONNX files themselves)."""
    target = _target_of(device)
    if target is None:
        return
    compile_cu_dir(target, cu_dir, out / f"{target.name}-bin", _options(device), dag_path, jobs=1)


def _target_of(device: str):
    spec = devices()[device]
    return next((t for t in targets().values() if t.artifact == spec.artifact), None)


def _options(device: str):
    return from_text(_target_of(device).options, **devices()[device].compile_options)
