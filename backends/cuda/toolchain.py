"""Compile a CUDA C++ translation unit to PTX and to one cubin per architecture.

Two drivers with one result: `nvcc` (the default when the toolkit is installed) and NVRTC, in process
through `cuda-bindings` (works from `pip install cuda-bindings nvidia-cuda-nvrtc`, no toolkit, no
GPU). Both run ptxas verbosely and we parse what it reports per kernel: registers, shared memory,
stack, spill stores and loads. PTX is written for the oldest requested architecture, so a driver can
JIT it for any newer GPU; the cubins are the ones the device loads when the GPU matches.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Sequence

from ir.errors import CortexError

DEFAULT_ARCHS = ("sm_80", "sm_90")
COMPILERS = ("auto", "nvcc", "nvrtc")
# Flags both drivers share; no fast-math, so cuda-sim (host libm) and the GPU agree closely.
COMMON_FLAGS = ("-std=c++17",)

_ARCH = re.compile(r"^sm_(\d+)[a-z]?$")
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


class CudaCompileError(CortexError):
    """The CUDA compiler rejected a source, or none is available."""


@dataclass
class KernelResources:
    registers: int = 0
    shared_bytes: int = 0        # static shared memory
    stack_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    barriers: int = 0

    @property
    def spills(self) -> bool:
        return bool(self.spill_store_bytes or self.spill_load_bytes)


@dataclass
class CompiledCuda:
    compiler: str                         # "nvcc 13.0" or "nvrtc 13.5"
    ptx: bytes
    ptx_arch: str                         # compute_XX of the PTX
    cubins: dict[str, bytes]              # arch -> cubin
    resources: dict[str, dict[str, KernelResources]] = field(default_factory=dict)  # arch -> kernel -> usage

    def spilling_kernels(self) -> list[str]:
        return sorted({f"{k} ({arch})" for arch, kernels in self.resources.items() for k, r in kernels.items() if r.spills})

    def resources_json(self) -> dict:
        return {arch: {k: asdict(r) for k, r in sorted(kernels.items())} for arch, kernels in sorted(self.resources.items())}


def parse_archs(text: str | Sequence[str]) -> tuple[str, ...]:
    archs = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    if not archs:
        raise CortexError("--arch needs at least one architecture, e.g. sm_80,sm_90")
    for arch in archs:
        if not _ARCH.match(arch):
            raise CortexError(f"--arch: {arch!r} is not a CUDA architecture like sm_80 or sm_90")
    return tuple(dict.fromkeys(archs))


def parse_ptxas_log(log: str) -> dict[str, dict[str, KernelResources]]:
    """ptxas -v output (from nvcc or NVRTC) -> arch -> kernel -> resources."""
    usage: dict[str, dict[str, KernelResources]] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = usage.setdefault(m.group(2), {}).setdefault(m.group(1), KernelResources())
        elif current is not None and (m := _FRAME.search(line)):
            current.stack_bytes, current.spill_store_bytes, current.spill_load_bytes = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current.registers = int(m.group(1))
            current.barriers = int(m.group(2) or 0)
            current.shared_bytes = int(m.group(3) or 0)
    return usage


@cache
def find_nvcc() -> str | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in candidates:
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


@cache
def toolkit_include() -> str | None:
    """A CUDA toolkit's include folder, for the headers NVRTC does not build in (`mma.h`,
    `cuda_pipeline.h`, which the tensor-core kernels include)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             *sorted(str(p) for p in Path("/usr/local").glob("cuda-*"))[::-1]]
    return next((str(Path(r) / "include") for r in roots if r and (Path(r) / "include" / "mma.h").is_file()), None)


@cache
def nvrtc_version() -> str | None:
    try:
        from cuda.bindings import nvrtc
        result, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # not installed, or the NVRTC library cannot be loaded
        return None
    return f"{major}.{minor}" if result == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


@cache
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def choose_compiler(requested: str = "auto") -> str:
    if requested not in COMPILERS:
        raise CortexError(f"--compiler must be one of nvcc, nvrtc (got {requested!r})")
    if requested in ("auto", "nvcc") and find_nvcc():
        return "nvcc"
    if requested == "nvcc":
        raise CudaCompileError("--compiler nvcc: nvcc not found (looked in $CUDA_HOME/bin, /usr/local/cuda/bin, PATH)")
    if nvrtc_version():
        return "nvrtc"
    raise CudaCompileError("no CUDA compiler: install the CUDA toolkit (nvcc) or the Python packages "
                           "cuda-bindings and nvidia-cuda-nvrtc (NVRTC)")


def compile_cuda(source: str, name: str, archs: Sequence[str] = DEFAULT_ARCHS, compiler: str = "auto") -> CompiledCuda:
    """Compile one translation unit; `name` (e.g. cu-0007.cu) appears in messages and nothing else."""
    archs = parse_archs(archs)
    chosen = choose_compiler(compiler)
    ptx_arch = "compute_" + min(archs, key=lambda a: int(_ARCH.match(a).group(1))).split("_")[1]
    if chosen == "nvcc":
        return _compile_nvcc(source, name, archs, ptx_arch)
    return _compile_nvrtc(source, name, archs, ptx_arch)


def _compile_nvcc(source: str, name: str, archs: Sequence[str], ptx_arch: str) -> CompiledCuda:
    nvcc = find_nvcc()
    # A fixed file name in a fresh folder: nothing about the build machine leaks into the outputs.
    with tempfile.TemporaryDirectory(prefix="cortex-nvcc-") as tmp:
        Path(tmp, "cu.cu").write_text(source)
        def run(*args: str) -> str:
            result = subprocess.run([nvcc, *COMMON_FLAGS, *args], cwd=tmp, capture_output=True, text=True)
            if result.returncode != 0:
                raise CudaCompileError(f"nvcc could not compile {name}: {_first_error(result.stderr)}")
            return result.stderr + result.stdout
        run("-ptx", f"-arch={ptx_arch}", "cu.cu", "-o", "cu.ptx")
        log, cubins = "", {}
        for arch in archs:
            log += run("-cubin", f"-arch={arch}", "-Xptxas", "-v", "-Xptxas", "-warn-spills", "cu.cu", "-o", f"{arch}.cubin")
            cubins[arch] = Path(tmp, f"{arch}.cubin").read_bytes()
        ptx = Path(tmp, "cu.ptx").read_bytes()
    return CompiledCuda(f"nvcc {nvcc_version(nvcc)}", ptx, ptx_arch, cubins, parse_ptxas_log(log))


def _compile_nvrtc(source: str, name: str, archs: Sequence[str], ptx_arch: str) -> CompiledCuda:
    from cuda.bindings import nvrtc

    def compile_for(arch: str, verbose: bool) -> tuple[bytes, str]:
        result, program = nvrtc.nvrtcCreateProgram(source.encode(), b"cu.cu", 0, [], [])
        _check_nvrtc(result, name)
        try:
            options = [f"--gpu-architecture={arch}".encode(), *(f.encode() for f in COMMON_FLAGS)]
            if "#include <mma.h>" in source and toolkit_include():
                options.append(f"--include-path={toolkit_include()}".encode())
            if verbose:
                options += [b"--ptxas-options=-v", b"--ptxas-options=-warn-spills"]
            (compiled,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
            result, size = nvrtc.nvrtcGetProgramLogSize(program)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            log_text = log.rstrip(b"\0 ").decode(errors="replace")
            if compiled != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise CudaCompileError(f"NVRTC could not compile {name}: {_first_error(log_text)}")
            get_size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if arch.startswith("compute_")
                             else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
            result, size = get_size(program)
            data = b" " * size
            get(program, data)
            return (data.rstrip(b"\0") if arch.startswith("compute_") else data), log_text
        finally:
            nvrtc.nvrtcDestroyProgram(program)

    ptx, _ = compile_for(ptx_arch, verbose=False)
    cubins, log = {}, ""
    for arch in archs:
        cubins[arch], arch_log = compile_for(arch, verbose=True)
        log += arch_log + "\n"
    return CompiledCuda(f"nvrtc {nvrtc_version()}", ptx, ptx_arch, cubins, parse_ptxas_log(log))


def _check_nvrtc(result, name: str) -> None:
    from cuda.bindings import nvrtc
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaCompileError(f"NVRTC failed on {name}: {result.name}")


def _first_error(log: str) -> str:
    lines = [l.strip() for l in log.splitlines() if "error" in l.lower()] or [l.strip() for l in log.splitlines() if l.strip()]
    return lines[0] if lines else "no diagnostic"
