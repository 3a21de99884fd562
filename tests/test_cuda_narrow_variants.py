"""A `--variants bf16,fp16,int8` weight on the CUDA target, read narrow by narrow_gemv's kernel (one
warp a column, B widened in registers), run on cuda-sim against onnxruntime on the variant's own
graph: the Cast (and Mul) widening in front of the product, which the kernel must equal up to
float32 rounding (bf16 and fp16 widen exactly; int8 scales each column's sum once instead of each
product). Products of few rows and of several row groups, K and N multiples of neither 32 nor the
16-byte vectors, Gemm with transposes and a bias, fused epilogues; the float32 and many-row products
that stay loop nests; the compiled variants' weight bytes against the exact CU's; the GPU check's
variant products in its dry run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from cuda_cases import cuda_compiler_available, run_cuda_source
from onnx import TensorProto, helper, numpy_helper
from testdata import run_onnxruntime

from backends.cuda.build import CudaOptions
from backends.cuda.kernels import CudaContractionKernels
from backends.cuda.render import render_cuda
from backends.cuda.runner import CuRunner
from backends.registry import target
from codegen.lower import lower_graph
from cortex.commands.decompose import decompose_model
from cortex.compile import compile_cu_dir
from cortex.dag import build_dag
from ir.fs import write_bytes_atomically
from ir.onnx_export import export_model
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.narrow_weights import narrowed
from passes.partition import PartitionIntoCUs

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not cuda_compiler_available(), reason="no CUDA compiler (cuda-sim needs its headers)")

FORMATS = ("bf16", "fp16", "int8")
RNG = np.random.default_rng(11)


def product_model(m: int, k: int, n: int, *, gemm: dict | None = None, after: tuple[str, ...] = ()) -> onnx.ModelProto:
    """y = MatMul(a, w) (or Gemm(a, w, c) with `gemm`'s attributes), then the ops of `after` in turn:
    "bias" (Add of a constant row), "residual" (Add of the input r), "relu", "gelu"."""
    w_shape = (n, k) if gemm and gemm.get("transB") else (k, n)
    a_shape = [k, m] if gemm and gemm.get("transA") else [m, k]
    weights = [numpy_helper.from_array((RNG.standard_normal(w_shape) / np.sqrt(k)).astype(np.float32), "w")]
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape)]
    if gemm is not None:
        weights.append(numpy_helper.from_array(RNG.standard_normal(n).astype(np.float32), "c"))
        nodes = [helper.make_node("Gemm", ["a", "w", "c"], ["t0"], **gemm)]
    else:
        nodes = [helper.make_node("MatMul", ["a", "w"], ["t0"])]
    for i, op in enumerate(after):
        x, y = f"t{i}", f"t{i + 1}"
        if op == "bias":
            weights.append(numpy_helper.from_array(RNG.standard_normal(n).astype(np.float32), "bias"))
            nodes.append(helper.make_node("Add", [x, "bias"], [y]))
        elif op == "residual":
            inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [m, n]))
            nodes.append(helper.make_node("Add", [x, "r"], [y]))
        else:
            nodes.append(helper.make_node(op.capitalize(), [x], [y]))
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "product", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return model


def feeds_for(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    return {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def variant_source(model: onnx.ModelProto, precision: str | None, archs=("sm_80",)):
    """The variant's graph as compile-cuda builds it (weight-only: CUDA has no integer GEMM), as an
    ONNX model for onnxruntime, and rendered; the exact graph with `precision` None."""
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    if precision is not None:
        graph = narrowed(graph, precision, target("cuda").integer_gemm)
    reference = export_model(graph)
    return reference, render_cuda(lower_graph(graph, CudaContractionKernels(archs)), "k")


def assert_matches_onnxruntime(source, reference: onnx.ModelProto, feeds: dict):
    """Other summation orders (and int8's scale once per sum): within 2e-6 of the largest output."""
    got, want = run_cuda_source(source, feeds)["y"], run_onnxruntime(reference, feeds)["y"]
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def narrow_launches(source, precision: str) -> list:
    return [launch for launch, line in zip(source.launches, _kernel_comments(source)) if f"B stored {precision}" in line]


def _kernel_comments(source) -> list[str]:
    """Each kernel's first comment line, in launch order."""
    lines = source.text.splitlines()
    heads = {re.search(r"\) (\w+)\(", line).group(1): lines[i + 1] for i, line in enumerate(lines)
             if line.startswith('extern "C"')}
    return [heads[launch.kernel] for launch in source.launches]


# K: not whole 16-byte vectors for either width (70: nor whole float4s of A; 76 and 100: whole float4s,
# a partial last vector); N not a multiple of 32 or of the 4 warps a block; M from a GEMV to 4 row groups.
@pytest.mark.parametrize("precision", FORMATS)
@pytest.mark.parametrize("m,k,n", [(1, 70, 45), (3, 76, 33), (4, 96, 7), (9, 100, 40), (15, 70, 19)])
def test_the_narrow_gemv_equals_the_variant_graph(precision, m, k, n):
    model = product_model(m, k, n)
    reference, source = variant_source(model, precision)
    (launch,) = source.launches
    assert narrow_launches(source, precision) == [launch]      # the widening never runs
    assert launch.grid == [-(-n // 4), -(-m // 4), 1] and launch.block == [128, 1, 1]
    assert_matches_onnxruntime(source, reference, feeds_for(model))


@pytest.mark.parametrize("precision", FORMATS)
@pytest.mark.parametrize("gemm", [{"transB": 1}, {"transA": 1, "transB": 1, "beta": 0.5}, {"transA": 1}])
def test_gemm_with_transposes_and_its_bias(precision, gemm):
    model = product_model(5, 84, 37, gemm=gemm)
    reference, source = variant_source(model, precision)
    assert len(narrow_launches(source, precision)) == 1 and len(source.launches) == 1
    assert_matches_onnxruntime(source, reference, feeds_for(model))


@pytest.mark.parametrize("precision", FORMATS)
@pytest.mark.parametrize("after", [("bias", "relu"), ("residual", "gelu"), ("bias", "residual")])
def test_fused_epilogues(precision, after):
    model = product_model(2, 64, 24, after=after)
    reference, source = variant_source(model, precision)
    assert len(narrow_launches(source, precision)) == 1
    assert_matches_onnxruntime(source, reference, feeds_for(model))


def test_the_int8_scale_multiplies_each_sum_once():
    """Codes up to 127 times scales near 1 / 127 over K = 200: the kernel's sum of a * code, scaled
    once, against the graph's sum of a * (code * scale)."""
    model = product_model(1, 200, 48)
    _, source = variant_source(model, "int8")
    assert "acc[r] * ((const float*)" in source.text and source.text.count("8388736.0f") == 4


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_float32_and_many_row_products_stay_loop_nests(precision):
    """A float32 GEMM is not offered (its loop nests take the renderer's tiles); nor is a narrow one
    of 16 rows or more, which those tiles (or tensor cores) read each B tile once for."""
    model = product_model(1 if precision is None else 16, 40, 24)
    reference, source = variant_source(model, precision)
    assert "one warp a column" not in source.text
    assert_matches_onnxruntime(source, reference, feeds_for(model))


def test_without_the_kernels_the_variant_widens_in_the_graph():
    graph, _ = run_pipeline(import_model(product_model(2, 40, 24)), optimize_pipeline(require_static=True))
    source = render_cuda(lower_graph(narrowed(graph, "fp16", integer_gemm=False)), "k")
    assert "one warp a column" not in source.text and len(source.launches) > 1


def compiled_dag(model: onnx.ModelProto, out: Path, variants: tuple[str, ...]) -> dict:
    """decompose (one CU) -> build-dag -> compile-cuda --variants; the dag.json's contents."""
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out / "model.onnx")
    decompose_model(out / "model.onnx", out / "cus", PartitionIntoCUs(10**9, 10**9, 100))
    dag_path = out / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out / "cus", dag_path), indent=2).encode())
    compile_cu_dir(target("cuda"), out / "cus", out / "cuda-bin", CudaOptions(("sm_80", "sm_90")), dag_path,
                   variants=variants)
    return json.loads(dag_path.read_text())


SHARE = {"bf16": 0.55, "fp16": 0.55, "int8": 0.3}


def test_compiled_variants_hold_the_narrow_bytes_and_run_on_cuda_sim(tmp_path):
    """compile-cuda --variants bf16,fp16,int8 on a decoder-step MatMul: each variant's CU is one
    launch of the narrow kernel, holds at most SHARE of the exact CU's weight bytes, and runs (as
    the cuda-sim device runs a CU) equal to onnxruntime on its own graph."""
    model = product_model(1, 200, 72)
    dag = compiled_dag(model, tmp_path, FORMATS)
    (cu,) = dag["cus"]
    exact_bytes = cu["artifacts"]["cuda"]["weights"]["bytes"]
    feeds = feeds_for(model)
    for precision in FORMATS:
        record = cu["variants"][precision]["artifacts"]["cuda"]
        assert [launch["op_type"] for launch in record["launches"]] == ["MatMul"], precision
        assert record["weights"]["bytes"] <= SHARE[precision] * exact_bytes, (precision, record["weights"]["bytes"])
        got = CuRunner(None, record, tmp_path / record["folder"], host_threads=2).run(feeds)["y"]
        reference, _ = variant_source(model, precision)
        want = run_onnxruntime(reference, feeds)["y"]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=precision)


@pytest.mark.slow
def test_the_gpu_check_dry_run_checks_each_variant(tmp_path):
    """bench/gpu_nbits_check.py's variant products on cuda-sim: one narrow-kernel launch each,
    equal to onnxruntime on the narrowed product the script builds by code."""
    run = subprocess.run([sys.executable, "-m", "bench.gpu_nbits_check", "--dry-run", "--shapes", "1x40x72",
                          "--variant-shape", "2x36x90", "--out", str(tmp_path / "build"),
                          "--output", str(tmp_path / "report.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    variants = json.loads((tmp_path / "report.json").read_text())["variants"]
    assert [row["variant"] for row in variants] == list(FORMATS)
    for row in variants:
        assert row["matches_onnxruntime"] and row["relative_error"] < 1e-5, row
        assert row["kernels"] == [f"cu0000{row['variant']}_000_MatMul"] and row["weight_gb_per_s"] > 0
        assert row["weight_share"] <= SHARE[row["variant"]]
