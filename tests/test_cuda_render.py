"""The CUDA renderer's parallelisation: which loops become threads, which stay loops, and when a
nest must run serially; and rendering is deterministic."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh

from codegen.parallel_loops import plan_parallel
from backends.cuda.render import BLOCK_THREADS, render_cuda
from codegen.lower import lower_graph
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from wasm_cases import make_model


def lowered(model):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return lower_graph(graph)


def matmul_model(m=5, k=7, n=3):
    w = nh.from_array(np.ones((k, n), np.float32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    return make_model([node], [helper.make_tensor_value_info("x", T.FLOAT, [m, k])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [m, n])], [w])


def test_matmul_runs_one_thread_per_output_with_the_reduction_inside():
    program = lowered(matmul_model())
    (kernel,) = program.kernels
    fill, accumulate = kernel.body
    assert [loop.extent for loop in plan_parallel(fill).threads] == [15]
    nest = plan_parallel(accumulate)
    assert [loop.var.name for loop in nest.threads] == ["i", "j"] and nest.thread_count == 15
    assert [loop.var.name for loop in nest.serial] == ["k"]


def test_scatter_with_data_dependent_indices_runs_serially():
    node = helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=0)
    model = make_model([node], [helper.make_tensor_value_info("x", T.FLOAT, [4, 3]),
                                helper.make_tensor_value_info("i", T.INT64, [2, 3]),
                                helper.make_tensor_value_info("u", T.FLOAT, [2, 3])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [4, 3])])
    source = render_cuda(lowered(model))
    copy, scatter = source.launches
    assert copy.threads == 12 and copy.block > 1
    assert scatter.threads == 1 and scatter.block == 1 and scatter.grid == 1


def test_softmax_rows_are_threads_and_each_row_reduces_inside_its_thread():
    node = helper.make_node("Softmax", ["x"], ["y"], axis=1)
    model = make_model([node], [helper.make_tensor_value_info("x", T.FLOAT, [6, 10, 4])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [6, 10, 4])])
    (launch,) = render_cuda(lowered(model)).launches
    assert launch.threads == 6 * 4


def test_launch_geometry_covers_every_thread_with_bounded_blocks():
    source = render_cuda(lowered(matmul_model(300, 9, 7)))   # too small in K and N for tiles
    for launch in source.launches:
        assert launch.block <= BLOCK_THREADS and launch.block % 32 == 0
        assert launch.grid * launch.block >= launch.threads > (launch.grid - 1) * launch.block


def test_rendering_is_deterministic():
    assert render_cuda(lowered(matmul_model())).text == render_cuda(lowered(matmul_model())).text


def test_parameter_layout_is_inputs_outputs_weights_scratch():
    source = render_cuda(lowered(matmul_model()))
    assert [(p.name, p.kind) for p in source.params] == [("x", "input"), ("y", "output"), ("weights", "weights"),
                                                         ("scratch", "scratch")]
    assert source.params[2].bytes == len(source.weights) >= 7 * 3 * 4


def _row_model(op, length, **attrs):
    inputs = ["x"] + (["scale", "bias"] if op == "LayerNormalization" else [])
    node = helper.make_node(op, inputs, ["y"], **attrs)
    vis = [helper.make_tensor_value_info("x", T.FLOAT, [3, 1, length])]
    vis += [helper.make_tensor_value_info(n, T.FLOAT, [length]) for n in inputs[1:]]
    return make_model([node], vis, [helper.make_tensor_value_info("y", T.FLOAT, [3, 1, length])])


def test_long_rows_reduce_on_a_warp_with_shuffles():
    for op in ("Softmax", "LayerNormalization"):
        source = render_cuda(lowered(_row_model(op, 300, axis=-1)))
        (launch,) = source.launches
        assert launch.threads == 3 * 32, op     # a warp a row
        assert "__shfl_xor_sync" in source.text and "lane; " in source.text


def test_short_rows_keep_one_thread_a_row():
    (launch,) = render_cuda(lowered(_row_model("Softmax", 16, axis=-1))).launches
    assert launch.threads == 3


def test_warp_rows_match_onnxruntime_under_permuted_order():
    from cuda_cases import run_cuda_sim
    from wasm_cases import run_onnxruntime
    rng = np.random.default_rng(1)
    for op in ("Softmax", "LogSoftmax", "LayerNormalization"):
        model = _row_model(op, 300, axis=-1)
        feeds = {"x": (rng.standard_normal((3, 1, 300)) * 4).astype(np.float32)}
        if op == "LayerNormalization":
            feeds.update(scale=rng.random(300).astype(np.float32), bias=rng.random(300).astype(np.float32))
        got = run_cuda_sim(model, feeds, seed=9)["y"]
        np.testing.assert_allclose(got, run_onnxruntime(model, feeds)["y"], rtol=1e-5, atol=1e-5, err_msg=op)


def test_large_contractions_stage_tiles_in_shared_memory_and_match_the_untiled_result():
    """MatMul and grouped Conv (as implicit GEMM) use 16x16 shared-memory tiles; every output adds
    its terms in the original order, so the result equals the one-thread-per-output kernel bit for bit."""
    from cuda_cases import run_cuda_sim
    rng = np.random.default_rng(2)
    w = nh.from_array(rng.standard_normal((70, 45)).astype(np.float32), "w")
    matmul = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                        [helper.make_tensor_value_info("x", T.FLOAT, [2, 37, 70])],
                        [helper.make_tensor_value_info("y", T.FLOAT, [2, 37, 45])], [w])
    wc = nh.from_array(rng.standard_normal((40, 6, 3, 3)).astype(np.float32), "wc")
    conv = make_model([helper.make_node("Conv", ["x", "wc"], ["y"], pads=[1, 1, 1, 1], strides=[2, 1], group=2)],
                      [helper.make_tensor_value_info("x", T.FLOAT, [2, 12, 19, 23])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [2, 40, 10, 23])], [wc])
    for model, shape in ((matmul, (2, 37, 70)), (conv, (2, 12, 19, 23))):
        feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
        tiled, source = run_cuda_sim(model, feeds, seed=4, with_source=True)
        assert "__shared__ float a_tile" in source
        untiled, source = run_cuda_sim(model, feeds, with_source=True, tiled=False)
        assert "a_tile" not in source
        np.testing.assert_array_equal(tiled["y"], untiled["y"])


def test_elementwise_chains_fuse_into_one_launch_and_still_match():
    from cuda_cases import run_cuda_sim
    from wasm_cases import run_onnxruntime
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Mul", ["r", "x"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [4, 33])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [4, 33])])
    (launch,) = render_cuda(lowered(model)).launches
    assert launch.op_type == "Add+Relu+Mul" and launch.threads == 4 * 33
    x = np.random.default_rng(3).standard_normal((4, 33)).astype(np.float32)
    np.testing.assert_array_equal(run_cuda_sim(model, {"x": x}, seed=2)["y"], run_onnxruntime(model, {"x": x})["y"])


def test_a_reader_of_a_neighbouring_cell_is_not_fused():
    """Slice reads cells another thread of the producing nest writes: it needs its own launch."""
    starts, ends = nh.from_array(np.array([1], np.int64), "s"), nh.from_array(np.array([33], np.int64), "e")
    axes = nh.from_array(np.array([1], np.int64), "ax")
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Slice", ["r", "s", "e", "ax"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [4, 33])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [4, 32])], [starts, ends, axes])
    assert [launch.op_type for launch in render_cuda(lowered(model)).launches] == ["Relu", "Slice"]


@pytest.mark.parametrize("name", ["test_bitcast_float32_to_int32", "test_bitcast_int64_to_float64",
                                  "test_bitshift_right_int8_negative_input", "test_bitshift_right_int64"])
def test_bitcast_and_arithmetic_shift_right_match_the_node_tests_bit_for_bit(name):
    import onnx

    from cuda_cases import run_cuda_sim
    from testdata import node_test_case
    case = node_test_case(name)
    got, source = run_cuda_sim(onnx.load(case.path), case.inputs, with_source=True)
    assert ("__float_as_int" in source or "__longlong_as_double" in source) if "bitcast" in name else ">>" in source
    for output, want in case.outputs.items():
        assert got[output].dtype == want.dtype
        np.testing.assert_array_equal(got[output].view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
