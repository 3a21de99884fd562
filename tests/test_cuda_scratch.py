"""The CUDA scratch space: temporaries share it by lifetime in launches. A chain of launches needs
less scratch than its temporaries add up to, still matches onnxruntime on cuda-sim, and the
temporaries one launch touches (several fused kernels' included) never overlap."""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh

from backends.cuda.render import ALIGN, render_cuda
from codegen.memory_plan import aligned_size, place_temporaries
from cuda_cases import run_cuda_sim
from codegen.lower import lower_graph
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from wasm_cases import make_model, run_onnxruntime

RNG = np.random.default_rng(7)
_SCRATCH_POINTER = re.compile(r"\bb(\d+) = \((?:const )?[\w ]+\*\)\(scratch \+ (\d+)\);")


def _weight(name, shape):
    return nh.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _info(name, shape):
    return helper.make_tensor_value_info(name, T.FLOAT, shape)


def mlp_chain():
    """MatMul + bias + Relu (one launch with the next product's zero fill), MatMul + Tanh, MatMul,
    Softmax: six launches, five temporaries of which at most four are alive in one launch."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["r1"]),
             helper.make_node("MatMul", ["r1", "w2"], ["m2"]), helper.make_node("Tanh", ["m2"], ["t2"]),
             helper.make_node("MatMul", ["t2", "w3"], ["m3"]), helper.make_node("Softmax", ["m3"], ["y"], axis=-1)]
    return make_model(nodes, [_info("x", [24, 40])], [_info("y", [24, 40])],
                      [_weight("w1", (40, 48)), _weight("b1", (48,)), _weight("w2", (48, 48)), _weight("w3", (48, 40))])


def elementwise_chain():
    """Maps that fuse into few launches around a Softmax that cannot: reuse across launches only."""
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Exp", ["n"], ["e"]),
             helper.make_node("Softmax", ["e"], ["s"], axis=-1), helper.make_node("Sqrt", ["s"], ["q"]),
             helper.make_node("Softmax", ["q"], ["t"], axis=0), helper.make_node("Abs", ["t"], ["y"])]
    return make_model(nodes, [_info("x", [16, 33])], [_info("y", [16, 33])])


def _lowered(model):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return lower_graph(graph)


def _temp_bytes(program) -> int:
    return sum(aligned_size(s.nbytes, ALIGN) for s in program.storages if s.kind == "temp")


def _scratch_ranges_by_launch(program, text: str) -> list[list[tuple[int, int, str]]]:
    """For each kernel function of the source, the scratch byte ranges of the temporaries it uses."""
    functions = text.split('extern "C" __global__')[1:]
    found = []
    for function in functions:
        ranges = {}
        for index, offset in _SCRATCH_POINTER.findall(function):
            storage = program.storages[int(index)]
            ranges[storage.name] = (int(offset), int(offset) + storage.nbytes, storage.name)
        found.append(sorted(ranges.values()))
    return found


def _overlapping_pairs(ranges: list[tuple[int, int, str]]) -> list[tuple[str, str]]:
    return [(a[2], b[2]) for i, a in enumerate(ranges) for b in ranges[i + 1:] if a[0] < b[1] and b[0] < a[1]]


@pytest.mark.parametrize("build", [mlp_chain, elementwise_chain])
def test_a_chain_of_launches_reuses_scratch_and_matches_onnxruntime(build):
    model = build()
    program = _lowered(model)
    source = render_cuda(program)
    assert 0 < source.scratch_bytes < _temp_bytes(program)
    feeds = {"x": RNG.standard_normal((24, 40) if build is mlp_chain else (16, 33)).astype(np.float32)}
    for seed in (0, 3):          # 3: threads of a launch in a permuted order
        got = run_cuda_sim(model, feeds, seed=seed)["y"]
        np.testing.assert_allclose(got, run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"epilogues": False}, {"tiled": False}])
@pytest.mark.parametrize("build", [mlp_chain, elementwise_chain])
def test_temporaries_of_one_launch_never_share_bytes(build, options):
    program = _lowered(build())
    source = render_cuda(program, **options)
    by_launch = _scratch_ranges_by_launch(program, source.text)
    assert len(by_launch) == len(source.launches)
    for launch, ranges in zip(source.launches, by_launch):
        assert _overlapping_pairs(ranges) == [], launch.kernel
        assert all(start % ALIGN == 0 for start, _, _ in ranges)


def test_lifetimes_are_measured_in_launches_not_node_kernels():
    """The fused launch of mlp_chain runs four node kernels at once: planned by kernels, two of its
    temporaries would share bytes (one is dead, kernel-wise, before the other is born)."""
    program = _lowered(mlp_chain())
    source = render_cuda(program)
    fused = [i for i, launch in enumerate(source.launches) if launch.op_type.count("+") >= 3]
    assert fused, [launch.op_type for launch in source.launches]
    in_launch = {name for _, _, name in _scratch_ranges_by_launch(program, source.text)[fused[0]]}
    by_kernel = place_temporaries(program, ALIGN)
    ranges = sorted((offset, offset + s.nbytes, s.name) for s, offset in by_kernel.offsets.items()
                    if s.name in in_launch)
    assert _overlapping_pairs(ranges)
