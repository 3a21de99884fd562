"""A CU whose outputs are all empty tensors renders no kernel: compile-cuda records it as kernel-free
(no source, PTX or cubins to build or load) and both CUDA devices run it by handing back its empty
outputs, like onnxruntime does."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cortex
from backends.cuda import device as cuda_device
from backends.cuda.toolchain import find_nvcc, nvrtc_version
from cuda_cases import HostMemoryGpu, compile_cuda_pipeline
from testdata import ModelCase, run_onnxruntime

HAS_COMPILER = find_nvcc() is not None or nvrtc_version() is not None


def _case(tmp_path, graph: onnx.GraphProto, inputs: dict) -> ModelCase:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / f"{graph.name}.onnx"
    onnx.save(model, path)
    return ModelCase(graph.name, path, inputs, run_onnxruntime(model, inputs))


def _empty_reshape(tmp_path) -> ModelCase:
    """Reshape [0, 3, 4] -> [3, 4, 0] with allowzero (onnx's test_reshape_allowzero_reordered)."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [3, 4, 0])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["data", "shape"], ["reshaped"], allowzero=1)], "empty_reshape",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, [0, 3, 4])],
        [helper.make_tensor_value_info("reshaped", TensorProto.FLOAT, [3, 4, 0])], initializer=[shape])
    return _case(tmp_path, graph, {"data": np.zeros((0, 3, 4), np.float32)})


def _split_with_an_empty_part(tmp_path) -> ModelCase:
    split = helper.make_tensor("split", TensorProto.INT64, [2], [3, 0])
    graph = helper.make_graph(
        [helper.make_node("Split", ["x", "split"], ["full", "empty"], axis=0)], "split_with_an_empty_part",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("full", TensorProto.FLOAT, [3, 2]),
         helper.make_tensor_value_info("empty", TensorProto.FLOAT, [0, 2])], initializer=[split])
    return _case(tmp_path, graph, {"x": np.arange(6, dtype=np.float32).reshape(3, 2)})


def _assert_same(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape and got[name].dtype == want.dtype, name
        np.testing.assert_array_equal(got[name], want)


def test_a_cu_with_only_empty_outputs_is_recorded_as_kernel_free(tmp_path):
    dag_path = compile_cuda_pipeline(_empty_reshape(tmp_path), tmp_path / "out")
    (cu,) = json.loads(dag_path.read_text())["cus"]
    record = cu["artifacts"]["cuda"]
    assert record["module"] is False and record["launches"] == []
    assert record["outputs"] == {"reshaped": "empty"}
    assert record["source"] is None and record["ptx"] is None and record["cubins"] == {}
    # Nothing to compile means nothing written but the (empty) weights.
    assert sorted(p.name for p in (tmp_path / "out" / "cuda-bin").iterdir()) == ["cu-0000.weights", "index.json"]


def test_a_kernel_free_cu_runs_on_cuda_sim_and_matches_onnxruntime(tmp_path):
    case = _empty_reshape(tmp_path)
    dag_path = compile_cuda_pipeline(case, tmp_path / "out")
    _assert_same(cortex.load(dag_path, device="cuda-sim").run(case.inputs), case.outputs)


class _GpuWithoutModules(HostMemoryGpu):
    """A stand-in for CudaDevice whose memory is host memory and which fails if asked to load code."""

    def __init__(self):
        super().__init__(sources_by_ptx={})

    def download(self, buffer, shape, dtype):
        assert int(np.prod(shape)) == 0, "only empty tensors come out of a kernel-free CU"
        return np.empty(shape, dtype)

    def load_module(self, cubins, ptx, signatures):
        raise AssertionError("a kernel-free CU must not load a module")


def test_a_kernel_free_cu_runs_on_the_gpu_path_without_loading_a_module(tmp_path, monkeypatch):
    case = _empty_reshape(tmp_path)
    dag_path = compile_cuda_pipeline(case, tmp_path / "out")
    monkeypatch.setattr(cuda_device, "CudaDevice", _GpuWithoutModules)
    _assert_same(cortex.load(dag_path, device="cuda").run(case.inputs), case.outputs)


@pytest.mark.skipif(not HAS_COMPILER, reason="no CUDA compiler (nvcc or NVRTC)")
def test_a_cu_with_one_empty_output_among_others_keeps_its_kernels(tmp_path):
    case = _split_with_an_empty_part(tmp_path)
    dag_path = compile_cuda_pipeline(case, tmp_path / "out")
    (cu,) = json.loads(dag_path.read_text())["cus"]
    record = cu["artifacts"]["cuda"]
    assert record["module"] is True and record["launches"]
    assert record["outputs"] == {"full": "kernels", "empty": "empty"}
    _assert_same(cortex.load(dag_path, device="cuda-sim").run(case.inputs), case.outputs)


def test_compile_cuda_and_run_on_cuda_sim_through_the_cli(tmp_path):
    from cli_helpers import run_cli
    case = _empty_reshape(tmp_path)
    dag_path = compile_cuda_pipeline(case, tmp_path / "out")
    code, out, _ = run_cli(["compile-cuda", "--cu-dir", str(tmp_path / "out" / "cus"), "--output",
                            str(tmp_path / "out" / "cuda-bin"), "--dag", str(dag_path), "--json"])
    assert code == 0
    summary = json.loads(out)
    assert summary["kernels"] == 0 and summary["compiler"] is None
    np.save(tmp_path / "data.npy", case.inputs["data"])
    code, out, err = run_cli(["run", str(dag_path), "--device", "cuda-sim", "--input", f"data={tmp_path / 'data.npy'}",
                              "--output", str(tmp_path / "y.npz")])
    assert code == 0, err
    assert np.load(tmp_path / "y.npz")["reshaped"].shape == (3, 4, 0)
