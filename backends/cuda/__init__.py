"""The CUDA backend: CUDA C++ per CU, compiled with nvcc or NVRTC, run on a GPU (`cuda`) or on the CPU
under host emulation (`cuda-sim`)."""
