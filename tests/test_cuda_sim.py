"""cuda-sim runs hand-written CUDA kernels on the CPU with CUDA's semantics: per-block shared memory,
barriers, warp shuffles and votes, atomics, dynamic shared memory, and clear refusals."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from backends.cuda.sim import SimModule, sanitizer_env
from ir.errors import CortexError


def module(tmp_path, source: str, name: str = "k.cu", **options) -> SimModule:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return SimModule(path, **options)


REDUCE = """
extern "C" __global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[128];
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
"""


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_shared_memory_reduction_is_right_under_permuted_fiber_order(tmp_path, seed):
    kernel = module(tmp_path, REDUCE).kernel("block_sum")
    x = np.random.default_rng(seed).standard_normal(5000).astype(np.float32)
    out = np.zeros(6, np.float32)
    kernel.launch(6, 128, 0, [x, out, x.size], seed=seed)
    expected = [x[np.arange(x.size) % (6 * 128) // 128 == b].astype(np.float64).sum() for b in range(6)]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_missing_barrier_is_exposed_by_permuted_order(tmp_path):
    # Each thread reads what its left neighbour wrote, without a __syncthreads in between. Fibers run
    # in order happen to see the value; a permuted order does not.
    racy = module(tmp_path, """
        extern "C" __global__ void shift(const float* x, float* y) {
            __shared__ float s[64];
            int t = threadIdx.x;
            s[t] = x[t];
            y[t] = t > 0 ? s[t - 1] : 0.f;
        }
    """).kernel("shift")
    x = np.arange(1, 65, dtype=np.float32)
    expected = np.concatenate([[0.0], x[:-1]]).astype(np.float32)
    in_order = np.zeros(64, np.float32)
    racy.launch(1, 64, 0, [x, in_order])
    np.testing.assert_array_equal(in_order, expected)
    permuted = [np.zeros(64, np.float32) for _ in range(3)]
    for seed, y in enumerate(permuted, start=1):
        racy.launch(1, 64, 0, [x, y], seed=seed)
    assert any(not np.array_equal(y, expected) for y in permuted)


def test_shared_memory_is_per_block_when_blocks_run_on_several_host_threads(tmp_path):
    kernel = module(tmp_path, REDUCE).kernel("block_sum")
    x = np.ones(64 * 128, np.float32)
    out = np.zeros(64, np.float32)
    kernel.launch(64, 128, 0, [x, out, x.size], host_threads=2, seed=7)
    np.testing.assert_array_equal(out, np.full(64, 128, np.float32))


SHUFFLES = """
extern "C" __global__ void shuffles(const int* x, int* out, int width) {
    int t = threadIdx.x, v = x[t];
    int n = blockDim.x;
    out[0 * n + t] = __shfl_sync(0xffffffffu, v, 3, width);
    out[1 * n + t] = __shfl_up_sync(0xffffffffu, v, 2, width);
    out[2 * n + t] = __shfl_down_sync(0xffffffffu, v, 3, width);
    out[3 * n + t] = __shfl_xor_sync(0xffffffffu, v, 5, width);
    out[4 * n + t] = (int)__ballot_sync(0xffffffffu, v % 3 == 0);
    out[5 * n + t] = __any_sync(0xffffffffu, v == 40);
    out[6 * n + t] = __all_sync(0xffffffffu, v >= 0);
    out[7 * n + t] = __all_sync(0xffffffffu, v % 2 == 0);
}
"""


def _shuffle_spec(x: np.ndarray, width: int) -> np.ndarray:
    """The CUDA Programming Guide's definition of each shuffle and vote, lane by lane."""
    n = x.size
    out = np.zeros((8, n), np.int64)
    for t in range(n):
        lane, warp = t % 32, t // 32
        lanes_in_warp = min(32, n - warp * 32)
        def read(src, in_range=True):
            return x[warp * 32 + src] if in_range and 0 <= src < lanes_in_warp else x[t]
        base = lane & ~(width - 1)
        out[0, t] = read(base + (3 & (width - 1)))
        out[1, t] = read(lane - 2, (lane % width) >= 2)
        out[2, t] = read(lane + 3, (lane % width) + 3 < width)
        out[3, t] = read(lane ^ 5, (lane ^ 5) < base + width)
        members = x[warp * 32: warp * 32 + lanes_in_warp]
        out[4, t] = sum(1 << i for i, m in enumerate(members) if m % 3 == 0)
        out[5, t] = int(any(members == 40))
        out[6, t] = int(all(members >= 0))
        out[7, t] = int(all(members % 2 == 0))
    return out.astype(np.uint32).view(np.int32).reshape(-1)


@pytest.mark.parametrize("threads,width", [(64, 32), (64, 8), (40, 16), (40, 4)])
def test_shuffles_and_votes_match_their_spec(tmp_path, threads, width):
    kernel = module(tmp_path, SHUFFLES).kernel("shuffles")
    x = (np.arange(threads, dtype=np.int32) * 7 + 1) % 97
    out = np.zeros(8 * threads, np.int32)
    kernel.launch(1, threads, 0, [x, out, width], seed=threads + width)
    np.testing.assert_array_equal(out.reshape(8, threads), _shuffle_spec(x, width).reshape(8, threads))


def test_warp_shuffle_reduction_with_dynamic_shared_memory(tmp_path):
    kernel = module(tmp_path, """
        extern "C" __global__ void row_sum(const float* x, float* out) {
            extern __shared__ __align__(16) float warp_sums[];
            float v = x[blockIdx.x * blockDim.x + threadIdx.x];
            for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
            if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = v;
            __syncthreads();
            if (threadIdx.x == 0) {
                float s = 0.f;
                for (int w = 0; w < blockDim.x / 32; ++w) s += warp_sums[w];
                out[blockIdx.x] = s;
            }
        }
    """).kernel("row_sum")
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    out = np.zeros(5, np.float32)
    kernel.launch(5, 256, 8 * 4, [x, out], seed=11)
    np.testing.assert_allclose(out, x.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_three_dimensional_grid_and_block_indices(tmp_path):
    kernel = module(tmp_path, """
        extern "C" __global__ void ids(int* out) {
            int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
            int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
            int threads = blockDim.x * blockDim.y * blockDim.z;
            out[block * threads + thread] = block * 1000 + threadIdx.z * 100 + threadIdx.y * 10 + threadIdx.x;
        }
    """).kernel("ids")
    out = np.zeros(2 * 3 * 2 * (4 * 3 * 2), np.int32)
    kernel.launch((2, 3, 2), (4, 3, 2), 0, [out], host_threads=2)
    z, y, x = np.meshgrid(range(2), range(3), range(4), indexing="ij")
    per_thread = (z * 100 + y * 10 + x).reshape(-1)
    expected = (np.arange(12)[:, None] * 1000 + per_thread[None, :]).reshape(-1)
    np.testing.assert_array_equal(out, expected)


def test_atomic_add_counts_every_thread_across_host_threads(tmp_path):
    kernel = module(tmp_path, """
        extern "C" __global__ void count(unsigned int* counter, float* total) {
            atomicAdd(counter, 1u);
            atomicAdd(total, 0.5f);
        }
    """).kernel("count")
    counter, total = np.zeros(1, np.uint32), np.zeros(1, np.float32)
    kernel.launch(50, 96, 0, [counter, total], host_threads=2)
    assert counter[0] == 50 * 96 and total[0] == 50 * 96 * 0.5


def test_half_precision_round_trips_like_binary16(tmp_path):
    kernel = module(tmp_path, """
        extern "C" __global__ void to_half(const float* x, __half* h, float* back) {
            int i = threadIdx.x;
            h[i] = __float2half(x[i]);
            back[i] = __half2float(__hmul(h[i], __float2half(2.0f)));
        }
    """).kernel("to_half")
    x = np.array([0.1, 1.5, -3.3, 65504.0, 1e-5, 70000.0, 0.0, -0.0], np.float32)
    h, back = np.zeros(8, np.float16), np.zeros(8, np.float32)
    kernel.launch(1, 8, 0, [x, h, back])
    with np.errstate(over="ignore"):  # 70000 and 2 * 65504 overflow to inf, in binary16 as on a GPU
        np.testing.assert_array_equal(h, x.astype(np.float16))
        np.testing.assert_array_equal(back, (x.astype(np.float16) * np.float16(2)).astype(np.float32))


def test_diverged_barriers_are_reported_as_a_deadlock(tmp_path):
    kernel = module(tmp_path, """
        extern "C" __global__ void diverged(float* y) {
            if (threadIdx.x < 16) __syncthreads(); else __syncwarp();
            y[threadIdx.x] = 1.f;
        }
    """).kernel("diverged")
    with pytest.raises(CortexError, match="deadlock"):
        kernel.launch(1, 32, 0, [np.zeros(32, np.float32)])


def test_launch_mistakes_are_one_line_errors(tmp_path):
    kernel = module(tmp_path, REDUCE).kernel("block_sum")
    x, out = np.zeros(4, np.float32), np.zeros(1, np.float32)
    with pytest.raises(CortexError, match="at most 1024"):
        kernel.launch(1, 2048, 0, [x, out, 4])
    with pytest.raises(CortexError, match="takes 3 parameters"):
        kernel.launch(1, 32, 0, [x, out])
    with pytest.raises(CortexError, match="exceeds 232448"):
        kernel.launch(1, 32, 300_000, [x, out, 4])


INLINE_PTX = """
extern "C" __global__ void lane_ids(int* out) {
    int lane;
#if USE_PTX
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
#else
    lane = threadIdx.x % 32;
#endif
    out[threadIdx.x] = lane;
}
"""


def test_inline_ptx_is_refused_clearly_and_its_fallback_runs(tmp_path):
    path = tmp_path / "ptx.cu"
    path.write_text(INLINE_PTX)
    with pytest.raises(CortexError, match=r"cannot emulate inline PTX \(asm\) used in .*ptx.cu"):
        SimModule(path, defines=["USE_PTX=1"])
    out = np.zeros(40, np.int32)
    SimModule(path, defines=["USE_PTX=0"]).kernel("lane_ids").launch(1, 40, 0, [out])
    np.testing.assert_array_equal(out, np.arange(40) % 32)


@pytest.mark.parametrize("construct,what", [
    ('asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {};");', r"inline PTX \(asm\), tensor-core mma"),
    ("cuda::memcpy_async(y, y + 1, 4, bar);", "cp.async"),
    ("cooperative_groups::this_grid().sync();", "grid-wide sync"),
])
def test_unemulated_features_are_refused_before_compiling(tmp_path, construct, what):
    path = tmp_path / "feature.cu"
    path.write_text(f'extern "C" __global__ void k(float* y) {{ {construct} }}\n')
    with pytest.raises(CortexError, match=f"cannot emulate {what}"):
        SimModule(path)


def test_a_source_that_does_not_compile_is_one_line_error(tmp_path):
    path = tmp_path / "broken.cu"
    path.write_text('extern "C" __global__ void k(float* y) { y[0] = undefined_name; }\n')
    with pytest.raises(CortexError, match="could not compile .*broken.cu.*undefined_name"):
        SimModule(path)


OUT_OF_BOUNDS = """
extern "C" __global__ void write_past_end(float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    y[i] = 1.f;   // no `if (i < n)`: the last block writes past the end
}
"""

SANITIZED_RUN = """
import sys, numpy as np
from backends.cuda.sim import SimModule
kernel = SimModule(sys.argv[1], sanitize=True).kernel("write_past_end")
n = int(sys.argv[2])
y = np.zeros(n, np.float32)
kernel.launch((n + 31) // 32, 32, 0, [y, n])
print("finished", y.sum())
"""


@pytest.mark.parametrize("n,caught", [(64, False), (50, True)])
def test_out_of_bounds_write_is_caught_under_asan(tmp_path, n, caught):
    path = tmp_path / "oob.cu"
    path.write_text(OUT_OF_BOUNDS)
    run = subprocess.run([sys.executable, "-c", SANITIZED_RUN, str(path), str(n)], capture_output=True,
                         text=True, env=sanitizer_env(), timeout=240)
    if caught:
        assert run.returncode != 0 and "heap-buffer-overflow" in run.stderr, run.stderr[-2000:]
        assert "write_past_end" in run.stderr
    else:
        assert run.returncode == 0 and "finished 64.0" in run.stdout, run.stderr[-2000:]


def test_sanitized_modules_refuse_to_load_without_libasan(tmp_path):
    path = tmp_path / "oob.cu"
    path.write_text(OUT_OF_BOUNDS)
    with pytest.raises(CortexError, match="libasan"):
        SimModule(path, sanitize=True)
