"""The CUDA renderer's parallelisation: which loops become threads, which stay loops, and when a
nest must run serially; and rendering is deterministic."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh

from backends.cuda.parallelize import plan_parallel
from backends.cuda.render import BLOCK_THREADS, render_cuda
from ir.loops import lower_graph
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
    source = render_cuda(lowered(matmul_model(300, 9, 7)))
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
