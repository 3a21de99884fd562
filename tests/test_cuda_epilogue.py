"""Fused epilogues on the tiled GEMM / implicit-GEMM conv: the elementwise nodes that read the
contraction's output only at the cell each thread owns run in the tiled kernel's store step (one
launch fewer each), and still match onnxruntime under a permuted thread order."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh

from backends.cuda import toolchain as cuda_compile
from backends.cuda.toolchain import compile_cuda
from backends.cuda.render import render_cuda
from codegen.lower import lower_graph
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from wasm_cases import make_model, run_onnxruntime

RNG = np.random.default_rng(11)


def _weight(name, shape):
    return nh.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _info(name, shape):
    return helper.make_tensor_value_info(name, T.FLOAT, shape)


def matmul_bias_relu():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    return make_model(nodes, [_info("x", [2, 37, 70])], [_info("y", [2, 37, 45])], [_weight("w", (70, 45)), _weight("b", (45,))])


def gemm_bias_sigmoid():
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["g"], transB=1), helper.make_node("Sigmoid", ["g"], ["y"])]
    return make_model(nodes, [_info("x", [40, 33])], [_info("y", [40, 29])], [_weight("w", (29, 33)), _weight("c", (29,))])


def conv_channel_bias_relu():
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "b"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    return make_model(nodes, [_info("x", [1, 8, 12, 13])], [_info("y", [1, 20, 12, 13])],
                      [_weight("wc", (20, 8, 3, 3)), _weight("b", (1, 20, 1, 1))])


def matmul_residual():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "r"], ["y"])]
    return make_model(nodes, [_info("x", [33, 40]), _info("r", [33, 24])], [_info("y", [33, 24])], [_weight("w", (40, 24))])


def matmul_then_transpose():
    """Transpose reads the product at another thread's cell: it must stay a launch of its own."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Transpose", ["m"], ["y"], perm=[1, 0])]
    return make_model(nodes, [_info("x", [32, 40])], [_info("y", [32, 32])], [_weight("w", (40, 32))])


def _lowered(model):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return lower_graph(graph)


def _without_epilogues(program):
    """The same build with epilogues off: the contraction is still tiled, the maps launch on their own."""
    source = render_cuda(program, epilogues=False)
    tiled = [launch for launch in source.launches if launch.block == [16, 16, 1]]
    assert tiled, "the contraction is no longer tiled"
    assert all("+" not in launch.op_type for launch in tiled)     # nothing fused into the tiled launch
    return source


FUSED_CASES = [
    pytest.param(matmul_bias_relu, {"x": (2, 37, 70)}, ["MatMul", "Add", "Relu"], id="matmul-bias-relu"),
    pytest.param(gemm_bias_sigmoid, {"x": (40, 33)}, ["Gemm", "Sigmoid"], id="gemm-bias-sigmoid"),
    pytest.param(conv_channel_bias_relu, {"x": (1, 8, 12, 13)}, ["Conv", "Add", "Relu"], id="conv-add-relu"),
    pytest.param(matmul_residual, {"x": (33, 40), "r": (33, 24)}, ["MatMul", "Add"], id="matmul-residual"),
]


@pytest.mark.parametrize("build, shapes, chain", FUSED_CASES)
def test_epilogue_runs_in_the_tiled_store_step_and_matches_onnxruntime(build, shapes, chain):
    from cuda_cases import run_cuda_sim
    model = build()
    source = render_cuda(_lowered(model))
    tiled = [launch for launch in source.launches if launch.block == [16, 16, 1]]
    assert len(tiled) == 1 and tiled[0].op_type.split("+")[-len(chain):] == chain
    assert "acc" in source.text.split("// fused:")[1]     # the sum is read from its register
    unfused = _without_epilogues(_lowered(model))
    assert len(source.launches) == len(unfused.launches) - 1    # the epilogue's own launch is gone
    feeds = {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    got = run_cuda_sim(model, feeds, seed=5)["y"]
    np.testing.assert_allclose(got, run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)


def test_a_reader_of_another_threads_cell_is_not_fused_into_the_tiled_kernel():
    from cuda_cases import run_cuda_sim
    model = matmul_then_transpose()
    source = render_cuda(_lowered(model))
    assert [launch.op_type for launch in source.launches][-2:] == ["MatMul", "Transpose"]
    assert "// fused:" not in source.text
    assert len(source.launches) == len(_without_epilogues(_lowered(model)).launches)
    feeds = {"x": RNG.standard_normal((32, 40)).astype(np.float32)}
    np.testing.assert_allclose(run_cuda_sim(model, feeds, seed=5)["y"], run_onnxruntime(model, feeds)["y"],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(cuda_compile.nvrtc_version() is None, reason="NVRTC not installed")
def test_fused_epilogue_kernels_compile_for_sm_80_without_spills():
    for build in (matmul_bias_relu, gemm_bias_sigmoid, conv_channel_bias_relu, matmul_residual):
        source = render_cuda(_lowered(build()))
        built = compile_cuda(source.text, "cu.cu", ("sm_80",), "nvrtc")
        assert built.spilling_kernels() == []
        assert set(source.kernel_names) <= set(built.resources["sm_80"])
