"""The `cuda` device: load cubins/PTX and launch kernels on a GPU through the CUDA driver API.

`cuda.bindings.driver` gives cuInit, cuModuleLoadData, cuLaunchKernel and cuMemAlloc/cuMemcpy*;
tensors are device allocations that stay on the GPU between launches and between CUs (only graph
inputs are copied in and graph outputs copied out). The interface matches cuda-sim's (`SimModule`,
`SimKernel.launch`), so the code that runs a CU's launch list is the same for both devices.

Without a driver (no libcuda.so.1) or without a GPU, opening the device is one clear error.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ir.errors import CortexError

_SCALARS = {"f32": ctypes.c_float, "f64": ctypes.c_double, "i8": ctypes.c_int8, "i16": ctypes.c_int16,
            "i32": ctypes.c_int32, "i64": ctypes.c_int64, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
            "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "bool": ctypes.c_bool}
# Above this much dynamic shared memory a kernel must opt in (cuFuncSetAttribute).
_DEFAULT_SHARED_LIMIT = 48 * 1024


class CudaDeviceError(CortexError):
    """No usable GPU, or the driver reported an error."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise CudaDeviceError("--device cuda needs the cuda-bindings package (pip install cuda-bindings)") from None
    return driver


def _check(result, what: str) -> None:
    driver = _driver()
    if result != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(result)
        detail = text.decode() if isinstance(text, bytes) else result.name
        raise CudaDeviceError(f"CUDA driver: {what} failed: {result.name} ({detail})")


def open_driver() -> None:
    """cuInit, with the two ways a machine without a GPU fails turned into one line each."""
    driver = _driver()
    try:
        (result,) = driver.cuInit(0)
    except Exception as e:  # the bindings raise when libcuda.so.1 cannot be loaded
        raise CudaDeviceError(f"--device cuda: no CUDA driver on this machine (libcuda.so.1 could not be "
                              f"loaded: {' '.join(str(e).split())[:160]}); use --device cuda-sim to run the "
                              "CUDA build on the CPU") from None
    if result == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        raise CudaDeviceError("--device cuda: the CUDA driver found no GPU (CUDA_ERROR_NO_DEVICE); use "
                              "--device cuda-sim to run the CUDA build on the CPU")
    _check(result, "cuInit")


@dataclass
class DeviceBuffer:
    ptr: int
    nbytes: int


class CudaDevice:
    """One GPU with a current context; kernels of loaded modules launch on its default stream."""

    def __init__(self, ordinal: int = 0):
        open_driver()
        driver = _driver()
        result, self.device = driver.cuDeviceGet(ordinal)
        _check(result, f"cuDeviceGet({ordinal})")
        result, self.context = driver.cuDevicePrimaryCtxRetain(self.device)
        _check(result, "cuDevicePrimaryCtxRetain")
        (result,) = driver.cuCtxSetCurrent(self.context)
        _check(result, "cuCtxSetCurrent")
        attr = driver.CUdevice_attribute
        result, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device)
        _check(result, "cuDeviceGetAttribute")
        result, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device)
        _check(result, "cuDeviceGetAttribute")
        self.arch = f"sm_{major}{minor}"
        result, name = driver.cuDeviceGetName(128, self.device)
        self.name = name.split(b"\0")[0].decode() if result == driver.CUresult.CUDA_SUCCESS else "GPU"

    # -- memory --------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DeviceBuffer:
        result, ptr = _driver().cuMemAlloc(max(1, nbytes))
        _check(result, f"cuMemAlloc({nbytes})")
        return DeviceBuffer(int(ptr), nbytes)

    def free(self, buffer: DeviceBuffer) -> None:
        _check(_driver().cuMemFree(buffer.ptr)[0], "cuMemFree")

    def upload(self, array: np.ndarray, buffer: DeviceBuffer | None = None) -> DeviceBuffer:
        array = np.ascontiguousarray(array)
        buffer = buffer or self.alloc(array.nbytes)
        if array.nbytes:
            _check(_driver().cuMemcpyHtoD(buffer.ptr, array.ctypes.data, array.nbytes)[0], "cuMemcpyHtoD")
        return buffer

    def download(self, buffer: DeviceBuffer, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        if out.nbytes:
            _check(_driver().cuMemcpyDtoH(out.ctypes.data, buffer.ptr, out.nbytes)[0], "cuMemcpyDtoH")
        return out

    def synchronize(self) -> None:
        _check(_driver().cuCtxSynchronize()[0], "cuCtxSynchronize")

    # -- code ----------------------------------------------------------------------------------
    def load_module(self, cubins: dict[str, bytes], ptx: bytes, signatures: dict[str, Sequence[str]]) -> CudaModule:
        """Load the cubin built for this GPU's architecture, else JIT the PTX."""
        image = cubins.get(self.arch) or (ptx.rstrip(b"\0") + b"\0")
        result, module = _driver().cuModuleLoadData(image)
        _check(result, f"cuModuleLoadData ({'cubin ' + self.arch if self.arch in cubins else 'PTX JIT'})")
        return CudaModule(module, signatures)


class CudaModule:
    def __init__(self, module, signatures: dict[str, Sequence[str]]):
        self.module = module
        self.kernels = {}
        for name, signature in signatures.items():
            result, function = _driver().cuModuleGetFunction(module, name.encode())
            _check(result, f"cuModuleGetFunction({name})")
            self.kernels[name] = CudaKernel(name, tuple(signature), function)

    def kernel(self, name: str) -> CudaKernel:
        if name not in self.kernels:
            raise CudaDeviceError(f"module has no kernel {name!r}")
        return self.kernels[name]


@dataclass
class CudaKernel:
    name: str
    signature: tuple[str, ...]
    function: object

    def launch(self, grid: Sequence[int], block: Sequence[int], shared_bytes: int, args: Sequence, **_) -> None:
        """cuLaunchKernel on the default stream. A pointer parameter takes a DeviceBuffer or an address."""
        driver = _driver()
        if len(args) != len(self.signature):
            raise CudaDeviceError(f"kernel {self.name} takes {len(self.signature)} parameters, got {len(args)}")
        values = []
        for code, value in zip(self.signature, args):
            if code == "ptr":
                values.append(ctypes.c_void_p(value.ptr if isinstance(value, DeviceBuffer) else int(value)))
            else:
                values.append(_SCALARS[code](value.item() if isinstance(value, np.generic) else value))
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        if shared_bytes > _DEFAULT_SHARED_LIMIT:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(self.function, attr, shared_bytes)[0], "cuFuncSetAttribute")
        g, b = _dims(grid), _dims(block)
        (result,) = driver.cuLaunchKernel(self.function, *g, *b, shared_bytes, 0, ctypes.addressof(pointers), 0)  # stream 0, no `extra`
        _check(result, f"cuLaunchKernel({self.name})")


def _dims(d) -> list[int]:
    d = [d] if isinstance(d, int) else list(d)
    return (d + [1, 1, 1])[:3]
