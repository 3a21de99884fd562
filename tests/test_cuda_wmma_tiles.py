"""The block-tiled tensor-core kernel (backends/cuda/wmma_tiled.py) on cuda-sim: every tiling matches
onnxruntime within its input precision at shapes off the tile on every side (M, N and K not multiples
of the block, K shorter than the pipeline ring), the rendered source holds the warp tile and the
multi-stage ring, the tiling follows the problem's size, and cuda-sim's deferred async copies expose a
kernel that reads a stage before waiting for it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from cuda_cases import run_cuda_sim, run_cuda_source
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh
from wasm_cases import make_model, run_onnxruntime

from backends.cuda import toolchain
from backends.cuda.render import render_cuda
from backends.cuda.sim import SimModule
from backends.cuda.tiled import TiledContraction
from backends.cuda.wmma_tiled import (
    BK,
    BY_NAME,
    STATIC_SHARED,
    TILINGS,
    choose_tiling,
    shared_layout,
)
from codegen.lower import lower_graph
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline

RNG = np.random.default_rng(90)
TOLERANCE = {"tf32": 2e-3, "fp16": 2e-3, "bf16": 2e-2}   # as in test_cuda_tensor_cores


def _info(name, shape):
    return helper.make_tensor_value_info(name, T.FLOAT, shape)


def matmul(m, k, n, batch=()):
    w = nh.from_array(RNG.standard_normal((k, n)).astype(np.float32), "w")
    b = nh.from_array(RNG.standard_normal((n,)).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    return make_model(nodes, [_info("x", [*batch, m, k])], [_info("y", [*batch, m, n])], [w, b])


def _close(got, want, precision):
    scale, error = float(np.abs(want).max()), float(np.abs(got - want).max())
    assert error <= TOLERANCE[precision] * scale, f"{precision}: max error {error:g} vs max |y| {scale:g}"


# (tiling, M, K, N, batch): each edge off the block; K = 16 is one K tile, fewer than the ring holds.
EDGES = [("128x64", 130, 40, 70, ()), ("64x64", 70, 16, 66, ()), ("32x32", 37, 20, 45, (2,))]


@pytest.mark.parametrize("precision", ["tf32", "fp16", "bf16"])
@pytest.mark.parametrize("tile,m,k,n,batch", EDGES)
def test_each_tiling_matches_onnxruntime_at_edge_shapes(tile, m, k, n, batch, precision):
    model = matmul(m, k, n, batch)
    feeds = {"x": RNG.standard_normal((*batch, m, k)).astype(np.float32)}
    got, source = run_cuda_sim(model, feeds, seed=7, with_source=True, precision=precision, tensor_core_tile=tile)
    t, stages = BY_NAME[tile], shared_layout(BY_NAME[tile], precision).stages
    assert f"{tile} block of {t.warps} warps, {t.frag_rows}x{t.frag_cols} fragments per warp, {stages} stages" in source
    assert f"acc_frag[{t.frag_rows}][{t.frag_cols}]" in source
    assert f"__pipeline_wait_prior({stages - 2})" in source and "__pipeline_memcpy_async" in source
    assert "Add" in source.split("tensor cores")[1].splitlines()[0]    # the bias stayed a fused epilogue
    _close(got["y"], run_onnxruntime(model, feeds)["y"], precision)


@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [1, 1, 1, 1]])
def test_conv_as_implicit_gemm_on_a_block_tiling_matches_onnxruntime(pads):
    """Unpadded taps are async copies; padded ones are computed and stored into the ring directly."""
    w = nh.from_array(RNG.standard_normal((40, 8, 3, 3)).astype(np.float32), "w")
    out = 9 if pads[0] else 7
    model = make_model([helper.make_node("Conv", ["x", "w"], ["y"], pads=pads)], [_info("x", [1, 8, 9, 9])],
                       [_info("y", [1, 40, out, out])], [w])
    feeds = {"x": RNG.standard_normal((1, 8, 9, 9)).astype(np.float32)}
    got, source = run_cuda_sim(model, feeds, seed=2, with_source=True, precision="tf32", tensor_core_tile="64x64")
    assert "64x64 block of 4 warps" in source
    _close(got["y"], run_onnxruntime(model, feeds)["y"], "tf32")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gemm_with_transposed_b_on_the_auto_tiling_matches_onnxruntime(precision):
    w = nh.from_array(RNG.standard_normal((33, 24)).astype(np.float32), "w")
    c = nh.from_array(RNG.standard_normal((33,)).astype(np.float32), "c")
    model = make_model([helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=0.5)],
                       [_info("x", [19, 24])], [_info("y", [19, 33])], [w, c])
    feeds = {"x": RNG.standard_normal((19, 24)).astype(np.float32)}
    got, source = run_cuda_sim(model, feeds, seed=4, with_source=True, precision=precision)
    assert "32x32 block of 4 warps" in source   # a small problem keeps the small tiling
    _close(got["y"], run_onnxruntime(model, feeds)["y"], precision)


def _plan(m, n, batch=1):
    loops = lambda e: [SimpleNamespace(extent=e)]
    return SimpleNamespace(rows=loops(m), cols=loops(n), batch=loops(batch), extent=TiledContraction.extent)


def test_the_tiling_is_the_largest_that_still_fills_every_sm():
    assert choose_tiling(_plan(4096, 4096)).name == "128x64"
    assert choose_tiling(_plan(1024, 1024)).name == "64x64"     # 128 blocks of 128x64 leave SMs idle
    assert choose_tiling(_plan(512, 512)).name == "32x32"
    assert choose_tiling(_plan(40, 40)).name == "32x32"
    assert choose_tiling(_plan(40, 40), "128x64").name == "128x64"


def test_every_tiling_fits_static_shared_memory_with_at_least_two_stages():
    for t in TILINGS:
        for precision in ("tf32", "fp16", "bf16"):
            layout = shared_layout(t, precision)
            assert layout.bytes(precision) <= STATIC_SHARED and layout.stages >= 2
    assert shared_layout(BY_NAME["128x64"], "tf32").stages == 3 and shared_layout(BY_NAME["64x64"], "bf16").stages == 3


def test_cuda_sim_exposes_a_stage_read_before_its_wait():
    """cuda-sim does an async copy only at the wait that needs it: waiting for one stage too few makes
    the warps read shared memory not yet filled, and the output goes wrong."""
    model = matmul(40, 48, 36)
    feeds = {"x": RNG.standard_normal((40, 48)).astype(np.float32)}
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    source = render_cuda(lower_graph(graph), "k", precision="tf32", tensor_core_tile="64x64")
    stages = shared_layout(BY_NAME["64x64"], "tf32").stages
    assert 48 // BK >= stages   # the ring really cycles
    want = run_onnxruntime(model, feeds)["y"]
    _close(run_cuda_source(source, feeds)["y"], want, "tf32")
    early = source.text.replace(f"__pipeline_wait_prior({stages - 2})", f"__pipeline_wait_prior({stages - 1})")
    got = run_cuda_source(source, feeds, text=early)["y"]
    assert not np.allclose(got, want, rtol=1e-2, atol=1e-2, equal_nan=False)


@pytest.mark.slow
def test_every_tiling_compiles_for_sm_90_without_spills():
    if not toolchain.find_nvcc():
        pytest.skip("nvcc is not installed")
    graph, _ = run_pipeline(import_model(matmul(256, 64, 256)), optimize_pipeline(require_static=True))
    program = lower_graph(graph)
    for t in TILINGS:
        for precision in ("tf32", "bf16"):
            source = render_cuda(program, "k", precision=precision, tensor_core_tile=t.name)
            built = toolchain.compile_cuda(source.text, "cu.cu", ("sm_90",), "nvcc")
            assert not built.spilling_kernels(), (t.name, precision)
            assert b"wmma.mma" in built.ptx or b"mma.sync" in built.ptx


def test_cli_tensor_core_tile_mistake_is_one_line(tmp_path):
    code, _, err = run_cli(["compile-cuda", "--cu-dir", tmp_path, "--output", tmp_path / "o", "--precision", "tf32",
                            "--tensor-core-tile", "48x48"])
    assert_one_line_error(code, err, "--tensor-core-tile")
    assert not (tmp_path / "o").exists()


PIPELINE = """
extern "C" __global__ void stages(const float* __restrict__ x, float* __restrict__ seen) {
    __shared__ float slot[4][32];
    __shared__ float many[200][32];
    const int t = threadIdx.x;
    for (int s = 0; s < 4; ++s) slot[s][t] = -1.0f;
    for (int s = 0; s < 3; ++s) {
        __pipeline_memcpy_async(&slot[s][t], &x[s * 32 + t], sizeof(float));
        __pipeline_commit();
    }
    __pipeline_memcpy_async(&slot[3][t], &x[3 * 32 + t], sizeof(float));   // not committed yet
    for (int wait = 2, row = 0; wait >= 0; --wait, ++row) {
        if (wait == 2) __pipeline_wait_prior(2);
        if (wait == 1) __pipeline_wait_prior(1);
        if (wait == 0) __pipeline_wait_prior(0);
        for (int s = 0; s < 4; ++s) seen[(row * 4 + s) * 32 + t] = slot[s][t];
    }
    __pipeline_commit();
    __pipeline_wait_prior(0);
    seen[(3 * 4 + 3) * 32 + t] = slot[3][t];
    for (int i = 0; i < 200; ++i) __pipeline_memcpy_async(&many[i][t], &x[t], sizeof(float));
    __pipeline_commit();
    __pipeline_wait_prior(0);
    float all = 0.0f;
    for (int i = 0; i < 200; ++i) all += many[i][t] == x[t] ? 1.0f : 0.0f;
    seen[(3 * 4 + 0) * 32 + t] = all;
}
"""


def test_cuda_sim_wait_prior_completes_all_but_the_newest_batches(tmp_path):
    """wait_prior(n) leaves exactly the newest n committed batches in flight, an uncommitted copy waits
    for its commit, and more copies than the queue holds all land."""

    path = tmp_path / "stages.cu"
    path.write_text(PIPELINE)
    x = np.arange(4 * 32, dtype=np.float32) + 1.0
    seen = np.zeros((4, 4, 32), np.float32)
    SimModule(path).kernel("stages").launch(1, 32, 0, [x, seen])
    stage = x.reshape(4, 32)
    for row, landed in enumerate((1, 2, 3)):     # after wait_prior(2), (1), (0)
        for s in range(4):
            np.testing.assert_array_equal(seen[row, s], stage[s] if s < landed else -1.0, err_msg=f"{row} {s}")
    np.testing.assert_array_equal(seen[3, 3], stage[3])
    np.testing.assert_array_equal(seen[3, 0], 200.0)
