"""cuda-sim: run an unchanged CUDA C++ translation unit on the CPU.

The source is compiled as host C++ (`g++ -std=c++20`, a shared library) with `sim/cuda_sim_shim.h`
force-included, together with the fiber scheduler `sim/cuda_sim_runtime.cpp`; each `extern "C"`
kernel gets a launcher with cuLaunchKernel's contract (grid, block, dynamic shared bytes, one pointer
per parameter value), called here through ctypes. "Device memory" is host memory: a pointer parameter
takes a numpy array. Built libraries are cached by the hash of everything that goes into them.

Options for tests: `sanitize=True` builds with AddressSanitizer and UBSan (the process must have
libasan preloaded: see `sanitizer_env`), and `seed=` permutes the order of blocks and of fibers at
every barrier, which exposes missing barriers.

The cache (`~/.cache/cortex/cuda-sim`) is bounded, oldest-used first: `CORTEX_SIM_CACHE_MB`, default
1024 (see `sim_cache`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Sequence

import numpy as np

from backends.cuda import sim_cache
from backends.cuda.sim_cache import cache_dir
from ir.errors import CortexError

SIM_DIR = Path(__file__).parent / "sim"
SHIM = SIM_DIR / "cuda_sim_shim.h"
WMMA = SIM_DIR / "cuda_sim_wmma.h"       # included by the shim
RUNTIME = SIM_DIR / "cuda_sim_runtime.cpp"
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g")

# What host emulation cannot do, spotted in the code that is active after preprocessing.
_UNEMULATED = [
    (re.compile(r"\basm\b|\b__asm__\b"), "inline PTX (asm)"),
    # The WMMA C++ API (`wmma::mma_sync`) and `__pipeline_memcpy_async` are emulated (sim/cuda_sim_wmma.h);
    # the PTX instructions underneath them are not.
    (re.compile(r"\bmma\.sync\b|\bwgmma\b"), "tensor-core mma"),
    (re.compile(r"\bcp\.async\b|(?<!__pipeline_)\bmemcpy_async\b|cp\.async\.bulk|\bcuda::barrier\b"), "cp.async / TMA copies"),
    (re.compile(r"\bthis_grid\s*\(|\bgrid_group\b|\bcudaLaunchCooperativeKernel\b"), "grid-wide sync"),
]
_KERNEL = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+([^;\[]+?)\s*\b(\w+)\s*\[\s*\]\s*;")
_ALIGN = re.compile(r"__align__\s*\(\s*\d+\s*\)")

_SCALARS = {"f32": ctypes.c_float, "f64": ctypes.c_double, "i8": ctypes.c_int8, "i16": ctypes.c_int16,
            "i32": ctypes.c_int32, "i64": ctypes.c_int64, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
            "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "bool": ctypes.c_bool}


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("host_threads", ctypes.c_uint), ("seed", ctypes.c_ulonglong)]


def kernel_names(source: str) -> list[str]:
    """The `__global__` functions of a source, in order of definition."""
    return list(dict.fromkeys(_KERNEL.findall(source)))


def dynamic_shared_declarations(source: str) -> list[tuple[str, str]]:
    """(type, name) of each `extern __shared__ T name[];`, which the sim must give storage."""
    found = {}
    for type_text, name in _EXTERN_SHARED.findall(source):
        found[name] = " ".join(_ALIGN.sub("", type_text).split())
    return [(t, n) for n, t in found.items()]


@cache
def compiler() -> str:
    gxx = os.environ.get("CXX") or shutil.which("g++")
    if not gxx:
        raise CortexError("cuda-sim needs a host C++ compiler: g++ not found on PATH (or set CXX)")
    return gxx


def unemulated_features(source_path: Path, defines: Sequence[str] = ()) -> list[str]:
    """Features in the active code of a source (after the preprocessor) that cuda-sim cannot run."""
    result = subprocess.run([compiler(), "-std=c++20", "-E", "-x", "c++", "-include", str(SHIM),
                             *(f"-D{d}" for d in defines), str(source_path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise CortexError(f"cuda-sim cannot preprocess {source_path}: {_first_error(result.stderr)}")
    own, found = False, []
    target = os.path.realpath(source_path)
    for line in result.stdout.splitlines():
        if line.startswith("# "):
            parts = line.split('"')
            own = len(parts) > 1 and os.path.realpath(parts[1]) == target if parts[1:] else own
            continue
        if own:
            found += [what for pattern, what in _UNEMULATED if pattern.search(line) and what not in found]
    return found


def _first_error(stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if "error" in l] or stderr.strip().splitlines() or ["no output"]
    return lines[0].strip()


def build(source_path: str | os.PathLike, *, sanitize: bool = False, opt: str = "-O1",
          defines: Sequence[str] = ()) -> Path:
    """Compile a .cu for the host; return the cached shared library."""
    source_path = Path(source_path)
    try:
        source = source_path.read_text()
    except OSError as e:
        raise CortexError(f"cannot read CUDA source {source_path}: {e.strerror}") from None
    kernels = kernel_names(source)
    if not kernels:
        raise CortexError(f"{source_path} defines no __global__ kernel")
    sim_cache.limit_bytes()   # a bad CORTEX_SIM_CACHE_MB fails before any work
    refused = unemulated_features(source_path, defines)
    if refused:
        raise CortexError(f"cuda-sim cannot emulate {', '.join(refused)} used in {source_path}; "
                          "build the CUDA artifact without those code paths to run it on cuda-sim")
    # The source is compiled from a copy with a fixed name, so the cache key is its content alone.
    wrapper = ['#include "cu.cu"']
    wrapper += [f"CUDA_SIM_DYNAMIC_SHARED({t}, {n})" for t, n in dynamic_shared_declarations(source)]
    wrapper += [f"CUDA_SIM_EXPORT_KERNEL({k})" for k in kernels]
    wrapper_text = "\n".join(wrapper) + "\n"
    flags = ["-std=c++20", opt, "-fPIC", "-fvisibility=hidden", "-pthread",
             *(f"-D{d}" for d in defines), *(SANITIZE_FLAGS if sanitize else ())]
    key = hashlib.sha256()
    for part in (source, SHIM.read_text(), WMMA.read_text(), RUNTIME.read_text(), wrapper_text, " ".join(flags), compiler()):
        key.update(part.encode() + b"\0")
    library = cache_dir() / f"{source_path.stem}-{key.hexdigest()[:20]}.so"
    if library.exists():
        sim_cache.mark_used(library)
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    runtime = _runtime_object(flags)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        Path(tmp, "cu.cu").write_text(source)
        Path(tmp, "cuda_sim_module.cpp").write_text(wrapper_text)
        built = Path(tmp) / library.name
        result = subprocess.run([compiler(), *flags, "-shared", "-include", str(SHIM), "cuda_sim_module.cpp",
                                 str(runtime), "-o", built.name], capture_output=True, text=True, cwd=tmp)
        if result.returncode != 0:
            message = _first_error(result.stderr).replace("cu.cu:", f"{source_path.name}:")
            raise CortexError(f"cuda-sim could not compile {source_path}: {message}")
        os.replace(built, library)
    sim_cache.prune()   # the cache only grows here
    return library


def _runtime_object(flags: list[str]) -> Path:
    """The fiber scheduler, compiled once per set of flags and shared by every module."""
    key = hashlib.sha256()
    for part in (SHIM.read_text(), RUNTIME.read_text(), " ".join(flags), compiler()):
        key.update(part.encode() + b"\0")
    obj = cache_dir() / f"cuda_sim_runtime-{key.hexdigest()[:20]}.o"
    if obj.exists():
        sim_cache.mark_used(obj)
        return obj
    obj.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=obj.parent) as tmp:
        built = Path(tmp) / obj.name
        result = subprocess.run([compiler(), *flags, "-c", "-include", str(SHIM), str(RUNTIME), "-o", str(built)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise CortexError(f"cuda-sim could not compile its runtime: {_first_error(result.stderr)}")
        os.replace(built, obj)
    return obj


def sanitizer_env(base: dict | None = None) -> dict:
    """Environment for a process that loads sanitized cuda-sim modules: libasan must come first."""
    env = dict(os.environ if base is None else base)
    libasan = subprocess.run([compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    env["LD_PRELOAD"] = libasan
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return env


def _asan_loaded() -> bool:
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


@dataclass
class SimKernel:
    name: str
    signature: tuple[str, ...]
    _launch: object
    _error: object

    def launch(self, grid: Sequence[int], block: Sequence[int], shared_bytes: int, args: Sequence,
               *, seed: int = 0, host_threads: int = 1) -> None:
        """Run the kernel to completion. A pointer parameter takes a numpy array (or an address)."""
        if len(args) != len(self.signature):
            raise CortexError(f"kernel {self.name} takes {len(self.signature)} parameters, got {len(args)}")
        values = [self._pack(code, value, i) for i, (code, value) in enumerate(zip(self.signature, args))]
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        config = LaunchConfig((ctypes.c_uint * 3)(*_dims(grid)), (ctypes.c_uint * 3)(*_dims(block)),
                              shared_bytes, host_threads, seed)
        if self._launch(ctypes.byref(config), pointers) != 0:
            raise CortexError(f"cuda-sim: kernel {self.name} failed: {self._error().decode()}")

    def _pack(self, code: str, value, index: int):
        if code == "ptr":
            if isinstance(value, np.ndarray):
                if not value.flags.c_contiguous:
                    raise CortexError(f"kernel {self.name} parameter {index}: array must be C-contiguous")
                return ctypes.c_void_p(value.ctypes.data)
            return ctypes.c_void_p(int(value))
        if code not in _SCALARS:
            raise CortexError(f"kernel {self.name} parameter {index}: cuda-sim cannot pass a {code} by value")
        return _SCALARS[code](value.item() if isinstance(value, np.generic) else value)


def _dims(d: Sequence[int] | int) -> list[int]:
    d = [d] if isinstance(d, int) else list(d)
    return (d + [1, 1, 1])[:3]


class SimModule:
    """A loaded .cu, like a CUmodule: kernels by name."""

    def __init__(self, source_path: str | os.PathLike, *, sanitize: bool = False, opt: str = "-O1",
                 defines: Sequence[str] = ()):
        if sanitize and not _asan_loaded():
            raise CortexError("cuda-sim with sanitizers needs libasan loaded first: run the process with "
                              "the environment from backends.cuda.sim.sanitizer_env()")
        self.path = Path(source_path)
        self.library_path = build(source_path, sanitize=sanitize, opt=opt, defines=defines)
        try:
            self._lib = ctypes.CDLL(str(self.library_path))
        except OSError:
            if self.library_path.exists():
                raise
            # Another process bounding the cache deleted it between the build and this load.
            self.library_path = build(source_path, sanitize=sanitize, opt=opt, defines=defines)
            self._lib = ctypes.CDLL(str(self.library_path))
        self._lib.cuda_sim_last_error.restype = ctypes.c_char_p
        self.kernels = {}
        for name in kernel_names(self.path.read_text()):
            signature = getattr(self._lib, f"cuda_sim_signature_{name}")
            signature.restype = ctypes.c_char_p
            launch = getattr(self._lib, f"cuda_sim_launch_{name}")
            launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.POINTER(ctypes.c_void_p)]
            launch.restype = ctypes.c_int
            codes = tuple(c for c in signature().decode().split(",") if c)
            self.kernels[name] = SimKernel(name, codes, launch, self._lib.cuda_sim_last_error)

    def kernel(self, name: str) -> SimKernel:
        if name not in self.kernels:
            raise CortexError(f"{self.path} has no kernel {name!r} (it has: {', '.join(self.kernels)})")
        return self.kernels[name]
