"""The `cuda` device: on a machine without a GPU, opening it is one clear error; with a GPU, a
hand-written kernel runs and matches numpy."""

from __future__ import annotations

import numpy as np
import pytest

from backends.cuda import device as cuda_device
from backends.cuda.toolchain import compile_cuda, find_nvcc, nvrtc_version
from backends.cuda.driver import CudaDevice, CudaDeviceError


def _gpu_available() -> bool:
    try:
        cuda_device.open_driver()
        return True
    except CudaDeviceError:
        return False


HAS_GPU = _gpu_available()


@pytest.mark.skipif(HAS_GPU, reason="this machine has a CUDA driver")
def test_without_a_driver_opening_the_device_is_one_clear_line():
    with pytest.raises(CudaDeviceError, match=r"no CUDA driver on this machine .* use --device cuda-sim") as info:
        CudaDevice()
    assert "\n" not in str(info.value)


def test_a_driver_without_a_gpu_is_one_clear_line(monkeypatch):
    from cuda.bindings import driver
    monkeypatch.setattr(driver, "cuInit", lambda flags: (driver.CUresult.CUDA_ERROR_NO_DEVICE,))
    with pytest.raises(CudaDeviceError, match=r"found no GPU \(CUDA_ERROR_NO_DEVICE\); use --device cuda-sim"):
        CudaDevice()


@pytest.mark.skipif(not HAS_GPU, reason="no GPU on this machine")
@pytest.mark.skipif(find_nvcc() is None and nvrtc_version() is None, reason="no CUDA compiler")
def test_a_kernel_runs_on_the_gpu_and_tensors_stay_on_the_device():
    source = """
    extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = a * x[i] + y[i];
    }
    """
    built = compile_cuda(source, "axpy.cu", ("sm_80", "sm_90"))
    gpu = CudaDevice()
    module = gpu.load_module(built.cubins, built.ptx, {"axpy": ("f32", "ptr", "ptr", "i32")})
    x = np.arange(1000, dtype=np.float32)
    y = np.ones(1000, np.float32)
    dx, dy = gpu.upload(x), gpu.upload(y)
    for _ in range(3):   # y stays on the device between launches
        module.kernel("axpy").launch((1000 + 255) // 256, 256, 0, [2.0, dx, dy, 1000])
    gpu.synchronize()
    np.testing.assert_allclose(gpu.download(dy, (1000,), np.float32), 1 + 3 * 2.0 * x)


@pytest.mark.skipif(find_nvcc() is None and nvrtc_version() is None, reason="no CUDA compiler")
def test_the_cuda_runtime_path_keeps_tensors_on_the_device_between_cus(tmp_path, monkeypatch):
    import json

    import cortex
    from cuda_cases import HostMemoryGpu, compile_cuda_pipeline
    from testdata import assert_values_close, sample_model
    case = sample_model("transformer_block")
    dag_path = compile_cuda_pipeline(case, tmp_path, min_cu_size=64, max_cu_depth=3)
    dag = json.loads(dag_path.read_text())
    assert len(dag["cus"]) > 1
    sources = {cu["artifacts"]["cuda"]["ptx"]["sha256"]: dag_path.parent / cu["artifacts"]["cuda"]["folder"]
               / cu["artifacts"]["cuda"]["source"]["file"] for cu in dag["cus"]}
    gpu = HostMemoryGpu(sources)
    monkeypatch.setattr(cuda_device, "CudaDevice", lambda: gpu)
    model = cortex.load(dag_path, device="cuda")
    uploads_at_load = gpu.uploads                   # the weights, once per CU
    got = model.run(case.inputs)
    assert_values_close(got, case.outputs, rtol=1e-4, atol=1e-5)
    assert gpu.uploads - uploads_at_load == len(case.inputs)   # only the model inputs go up
    assert gpu.downloads == len(case.outputs)                  # only the model outputs come back
