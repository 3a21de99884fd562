"""The CUDA target (CUDA C++ per CU, compiled with nvcc or NVRTC) and its two devices: a GPU
through the driver API (`cuda`) and the CPU under host emulation of the same source (`cuda-sim`)."""

from backends.cuda.build import (
    CudaOptions,
    build_cu,
    build_tf32_variant,
    check_tf32_variant,
    check_toolchain,
    place,
    summarize,
    toolchain_name,
)
from backends.cuda.device import CudaGpuDevice, CudaSimDevice, gpu_unavailable
from backends.registry import DeviceSpec, Target, TargetVariant, register_device, register_target

TARGET = register_target(Target(
    name="cuda", artifact="cuda", options=CudaOptions, build=build_cu, place=place, summarize=summarize,
    check=check_toolchain, toolchain=toolchain_name, jobs=4,
    variants={"tf32": TargetVariant(
        build=build_tf32_variant, check=check_tf32_variant,
        description="each CU with a large float32 contraction, its weights as they are and those contractions "
                    "on tf32 tensor cores (sm_80 or newer)")},
    description="Compile every CU to one CUDA translation unit, its PTX and a cubin per architecture."))
register_device(DeviceSpec(name="cuda", artifact="cuda", open=CudaGpuDevice, unavailable=gpu_unavailable,
                           description="an NVIDIA GPU through the CUDA driver API"))
register_device(DeviceSpec(name="cuda-sim", artifact="cuda", open=CudaSimDevice, compile_options={"compiler": "nvrtc"},
                           description="the CUDA source compiled for the host, blocks' threads as fibers"))
