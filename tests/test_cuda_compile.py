"""CUDA compilation with nvcc and with NVRTC: PTX plus one cubin per architecture, the resource usage
ptxas reports, determinism, and one-line errors."""

from __future__ import annotations

import pytest

from backends.cuda import toolchain as cuda_compile
from backends.cuda.toolchain import CudaCompileError, compile_cuda, parse_archs, parse_ptxas_log
from ir.errors import CortexError

KERNELS = """
extern "C" __global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[256];
    int t = threadIdx.x;
    float acc = 0.f;
    for (int i = blockIdx.x * blockDim.x + t; i < n; i += blockDim.x * gridDim.x) acc += x[i];
    partial[t] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) partial[t] += partial[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = partial[0];
}
extern "C" __global__ void warp_max(const float* x, float* out) {
    float v = x[blockIdx.x * 32 + threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) out[blockIdx.x] = v;
}
"""

needs_nvcc = pytest.mark.skipif(cuda_compile.find_nvcc() is None, reason="nvcc not installed")
needs_nvrtc = pytest.mark.skipif(cuda_compile.nvrtc_version() is None, reason="NVRTC not installed")
COMPILERS = [pytest.param("nvcc", marks=needs_nvcc), pytest.param("nvrtc", marks=needs_nvrtc)]


@pytest.mark.parametrize("compiler", COMPILERS)
def test_each_compiler_gives_ptx_and_a_cubin_per_arch_without_spills(compiler):
    built = compile_cuda(KERNELS, "kernels.cu", ("sm_80", "sm_90"), compiler)
    assert built.compiler.startswith(compiler)
    assert built.ptx_arch == "compute_80"
    assert b".target sm_80" in built.ptx and b".entry block_sum" in built.ptx and b".entry warp_max" in built.ptx
    assert set(built.cubins) == {"sm_80", "sm_90"}
    assert all(cubin[:4] == b"\x7fELF" for cubin in built.cubins.values())
    for arch in ("sm_80", "sm_90"):
        usage = built.resources[arch]
        assert set(usage) == {"block_sum", "warp_max"}
        assert usage["block_sum"].shared_bytes == 256 * 4 and usage["warp_max"].shared_bytes == 0
        assert all(0 < r.registers <= 255 and not r.spills for r in usage.values())
    assert built.spilling_kernels() == []


@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiling_twice_gives_identical_bytes(compiler):
    first = compile_cuda(KERNELS, "kernels.cu", ("sm_80",), compiler)
    second = compile_cuda(KERNELS, "other-name.cu", ("sm_80",), compiler)
    assert first.ptx == second.ptx and first.cubins == second.cubins


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_source_error_is_one_line_naming_the_file(compiler):
    with pytest.raises(CudaCompileError, match=r"could not compile cu-0003\.cu: .*undefined_name") as info:
        compile_cuda('extern "C" __global__ void k(float* y) { y[0] = undefined_name; }', "cu-0003.cu",
                     ("sm_80",), compiler)
    assert "\n" not in str(info.value)


def test_ptxas_report_is_parsed_per_arch_and_kernel_including_spills():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gemm' for 'sm_90'
ptxas info    : Function properties for gemm
ptxas         .     48 bytes stack frame, 40 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16384 bytes smem
ptxas info    : Compiling entry function 'relu' for 'sm_90'
ptxas info    : Function properties for relu
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, 380 bytes cmem[0]
"""
    usage = parse_ptxas_log(log)["sm_90"]
    assert (usage["gemm"].registers, usage["gemm"].shared_bytes, usage["gemm"].spill_store_bytes,
            usage["gemm"].spill_load_bytes, usage["gemm"].stack_bytes, usage["gemm"].barriers) == (255, 16384, 40, 44, 48, 1)
    assert usage["gemm"].spills and not usage["relu"].spills and usage["relu"].registers == 8


def test_architectures_are_checked():
    assert parse_archs("sm_80, sm_90,sm_80") == ("sm_80", "sm_90")
    with pytest.raises(CortexError, match="not a CUDA architecture"):
        parse_archs("ampere")
    with pytest.raises(CortexError, match="at least one"):
        parse_archs(" , ")


def test_no_compiler_at_all_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_compile, "find_nvcc", lambda: None)
    monkeypatch.setattr(cuda_compile, "nvrtc_version", lambda: None)
    with pytest.raises(CudaCompileError, match="no CUDA compiler: install the CUDA toolkit"):
        compile_cuda(KERNELS, "kernels.cu")
    with pytest.raises(CudaCompileError, match="nvcc not found"):
        compile_cuda(KERNELS, "kernels.cu", compiler="nvcc")
    with pytest.raises(CortexError, match="--compiler must be one of"):
        compile_cuda(KERNELS, "kernels.cu", compiler="clang")
