"""The WebAssembly target (SIMD128) and the wasm device (wasmtime)."""

from backends.registry import DeviceSpec, Target, register_device, register_target
from backends.wasm.build import build_cu, place, summarize
from backends.wasm.device import WasmDevice
from backends.wasm.options import WasmOptions

TARGET = register_target(Target(
    name="wasm", artifact="wasm", options=WasmOptions, build=build_cu, place=place, summarize=summarize,
    description="Compile every CU to a WebAssembly module (SIMD128 where enabled) that imports nothing."))
DEVICE = register_device(DeviceSpec(name="wasm", artifact="wasm", open=WasmDevice, sandboxed=True,
                                    description="wasmtime, in this process, one sandbox per CU"))
