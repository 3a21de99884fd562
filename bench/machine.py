"""What the benchmarks ran on, for the report: the numbers mean little without it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict:
    import onnxruntime
    import wasmtime  # noqa: F401  (its version comes from the package metadata)
    from importlib.metadata import version

    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip() or "missing"
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "wasmtime": version("wasmtime"),
        "node": node,
        # Other work on the machine slows every contestant; the interleaving spreads it evenly.
        "load_average": round(os.getloadavg()[0], 2),
    }
