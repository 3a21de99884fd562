"""MatMulNBits on the CUDA target, run on cuda-sim against onnxruntime: block_quant's kernels (one
warp a column reading the stored 4- and 8-bit codes; int8 A and __dp4a at accuracy level 4), the
loop nests where the kernels do not apply, the compiled artifact's narrow bytes, a --variants
bf16,int8 build, and the GPU check's dry run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from cuda_cases import cuda_compiler_available, run_cuda_source
from test_contrib_quantized import nbits_case, node_model
from testdata import run_onnxruntime

from backends.cuda.build import CudaOptions
from backends.cuda.kernels import CudaContractionKernels
from backends.cuda.render import render_cuda
from backends.cuda.runner import CuRunner
from backends.cuda.toolchain import find_nvcc
from backends.registry import target
from codegen.lower import lower_graph
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from ir.fs import write_bytes_atomically
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.partition import PartitionIntoCUs

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not cuda_compiler_available(), reason="no CUDA compiler (cuda-sim needs its headers)")


def rendered(model: onnx.ModelProto, archs=("sm_80",), kernels: bool = True):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return render_cuda(lower_graph(graph, CudaContractionKernels(archs) if kernels else None), "k")


def nbits_model(bits, k, n, block, zero_points=None, level=0, bias=False, rows=(3,)):
    feeds, constants, order, attrs = nbits_case(bits, k, n, block, zero_points, bias=bias, rows=rows)
    return node_model("MatMulNBits", feeds, constants, order, accuracy_level=level, **attrs), feeds


def assert_matches_onnxruntime(got: np.ndarray, want: np.ndarray):
    """The kernels sum in another order than onnxruntime: each output within 1e-6 of the largest."""
    assert np.abs(want).max() > 1.0     # codes and scales give outputs well away from 0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


# K of 2.5 blocks and 3: the last block is partial and its codes' padding must add nothing.
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("zero_points", [None, "packed"])
def test_block_quant_kernels_match_onnxruntime(level, bits, block, zero_points):
    model, feeds = nbits_model(bits, block * 5 // 2 + 3, 12, block, zero_points, level, bias=block == 64, rows=(2, 3))
    source = rendered(model)
    expected = ["k000_MatMulNBits_quantize_a", "k000_MatMulNBits"] if level == 4 else ["k000_MatMulNBits"]
    assert source.kernel_names == expected
    assert_matches_onnxruntime(run_cuda_source(source, feeds)["out"], run_onnxruntime(model, feeds)["out"])


def test_the_gemv_is_one_warp_per_column_reading_whole_blocks():
    model, _ = nbits_model(4, 4096, 64, 32, "packed", level=4, rows=(1,))
    source = rendered(model)
    quantize, gemv = source.launches
    assert (quantize.grid, quantize.block) == ([16, 1, 1], [256, 1, 1])   # 128 blocks of A, a warp each
    assert (gemv.grid, gemv.block) == ([16, 1, 1], [128, 1, 1])           # 64 columns, 4 warps a block
    assert "const uint4 q = stored[v];" in source.text and "__dp4a(" in source.text
    assert "blk += 32" in source.text                                       # lanes take the blocks in turn


def test_rows_beyond_four_take_more_warps():
    model, feeds = nbits_model(4, 64, 8, 32, level=0, rows=(9,))
    source = rendered(model)
    (gemv,) = source.launches
    assert gemv.grid == [2, 3, 1]                # 8 columns / 4 warps, 9 rows / 4 a warp
    assert_matches_onnxruntime(run_cuda_source(source, feeds)["out"], run_onnxruntime(model, feeds)["out"])


@pytest.mark.parametrize("case,archs", [
    ("2-bit: no kernel", ("sm_80",)),
    ("level 4 for sm_52: no __dp4a", ("sm_52",)),
    ("without kernels", None),
])
def test_the_loop_nests_still_match_where_the_kernels_do_not_apply(case, archs):
    bits, level = (2, 0) if case.startswith("2-bit") else (4, 4)
    model, feeds = nbits_model(bits, 80, 8, 32, "packed", level, bias=True, rows=(2, 3))
    source = rendered(model, archs or ("sm_80",), kernels=archs is not None)
    assert "one warp a column" not in source.text
    assert_matches_onnxruntime(run_cuda_source(source, feeds)["out"], run_onnxruntime(model, feeds)["out"])


def compiled_dag(model: onnx.ModelProto, out: Path, variants=(), compiler="auto") -> dict:
    """decompose (one CU) -> build-dag -> compile-cuda; the dag.json's contents."""
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out / "model.onnx")
    decompose_model(out / "model.onnx", out / "cus", PartitionIntoCUs(10**9, 10**9, 100))
    dag_path = out / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out / "cus", dag_path), indent=2).encode())
    compile_cu_dir(target("cuda"), out / "cus", out / "cuda-bin", CudaOptions(("sm_80", "sm_90"), compiler), dag_path,
                   variants=variants)
    return json.loads(dag_path.read_text())


def run_record(record: dict, folder: Path, feeds: dict) -> dict:
    return CuRunner(None, record, folder / record["folder"], host_threads=2).run(feeds)


def float_matmul(n: int, k: int, rows: int) -> onnx.ModelProto:
    w = onnx.numpy_helper.from_array(np.ones((k, n), np.float32), "w")
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["a", "w"], ["out"])], "mm",
                                   [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [rows, k])],
                                   [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [rows, n])], [w])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("level", [0, 4])
def test_compile_cuda_holds_the_4_bit_bytes_and_runs_on_cuda_sim(level, tmp_path):
    """Built with nvcc for sm_80 and sm_90 (the real compiler checks the kernels), run as the
    cuda-sim device runs a CU; 4-bit blocks of 32 with zero points take 0.16x of float32's bytes."""
    model, feeds = nbits_model(4, 512, 128, 32, "packed", level, rows=(1,))
    dag = compiled_dag(model, tmp_path / "nbits", compiler="nvcc")
    (cu,) = dag["cus"]
    record = cu["artifacts"]["cuda"]
    assert record["compiler"].startswith("nvcc") and not record["spills"]
    assert_matches_onnxruntime(run_record(record, tmp_path / "nbits", feeds)["out"], run_onnxruntime(model, feeds)["out"])
    (float_cu,) = compiled_dag(float_matmul(128, 512, 1), tmp_path / "float", compiler="nvcc")["cus"]
    share = record["weights"]["bytes"] / float_cu["artifacts"]["cuda"]["weights"]["bytes"]
    assert share <= 0.2, share


@pytest.mark.slow
def test_variants_bf16_and_int8_run_on_cuda_sim_as_their_narrowed_models(tmp_path):
    """compile-cuda --variants bf16,int8: each variant's CU (its weights stored narrow, widened by
    Cast and Mul in the graph: CUDA has no integer GEMM, so int8 stays weight-only) against
    onnxruntime on the model with those weights."""
    from variant_cases import embedding_mlp, feeds, narrowed_reference, weights
    w = weights(0)
    dag = compiled_dag(embedding_mlp(w), tmp_path, variants=("bf16", "int8"))
    (cu,) = dag["cus"]
    feed = feeds(1, seed=3)[0]
    exact = run_onnxruntime(embedding_mlp(w), feed)["y"]
    for precision in ("bf16", "int8"):
        record = cu["variants"][precision]["artifacts"]["cuda"]
        assert record["weights"]["bytes"] < cu["artifacts"]["cuda"]["weights"]["bytes"] / 2
        got = run_record(record, tmp_path, feed)["y"]
        want = run_onnxruntime(embedding_mlp(narrowed_reference(w, precision)), feed)["y"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=precision)
        assert np.abs(want - exact).max() > 1e-3     # the narrowed weights do change the outputs


@pytest.mark.slow
def test_the_gpu_check_dry_run_writes_its_report(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bench.gpu_nbits_check", "--dry-run", "--shapes", "2x40x72",
                          "--out", str(tmp_path / "build"), "--output", str(tmp_path / "report.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["device"] == "cuda-sim" and len(report["cases"]) == 4
    assert {c["accuracy_level"] for c in report["cases"]} == {0, 4}
    assert all(c["matches_onnxruntime"] and c["relative_error"] < 1e-5 for c in report["cases"])
