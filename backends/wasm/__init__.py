"""The WebAssembly target (SIMD128) and the wasm device (wasmtime)."""

from backends.registry import DeviceSpec, Target, register_device, register_target
from backends.wasm.build import build_cu, place, summarize
from backends.wasm.options import WasmOptions
from backends.wasm.shared_device import open_wasm_device
from backends.wasm.shared_memory import plan_shared_memory

TARGET = register_target(Target(
    name="wasm", artifact="wasm", options=WasmOptions, build=build_cu, place=place, summarize=summarize,
    links=lambda options: options.shared, link=plan_shared_memory, integer_gemm=True,
    description="Compile every CU to a WebAssembly module (SIMD128 where enabled) that imports nothing, or with --memory shared only the model's one memory."))
DEVICE = register_device(DeviceSpec(name="wasm", artifact="wasm", open=open_wasm_device, sandboxed=True,
                                    description="wasmtime, in this process, one sandbox per CU"))
