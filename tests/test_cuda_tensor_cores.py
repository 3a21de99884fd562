"""Tensor-core GEMM and implicit-GEMM Conv (WMMA, `--precision tf32|fp16|bf16`) on cuda-sim: the
rendered kernels really use wmma fragments and cuda_pipeline copies, match onnxruntime within the
rounding of their input precision (and not bit for bit: the rounding is real), keep fused
epilogues, and leave small or non-float contractions on the exact kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_helpers import assert_one_line_error, run_cli
from cuda_cases import run_cuda_sim
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh
from testdata import sample_model
from wasm_cases import make_model, run_onnxruntime

import cortex
from backends.cuda import toolchain
from backends.cuda.build import (
    CudaOptions,
    build_cu,
    build_tf32_variant,
    stored_weight_precision,
)
from backends.cuda.sim import sanitizer_env
from backends.cuda.tensor_cores import KSTEP
from backends.registry import targets
from cortex.compile import compile_cu_dir
from cortex.dag import validate_dag
from cortex.runtime.variants import chosen_variant
from ir.errors import CortexError
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.narrow_weights import narrowed

RNG = np.random.default_rng(16)
# Relative error of one input rounding (half an ulp at the precision's mantissa bits), times a
# margin for sums of K products with mixed signs, measured against the largest |output|.
TOLERANCE = {"tf32": 2e-3, "fp16": 2e-3, "bf16": 2e-2}


def _weight(name, shape):
    return nh.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _info(name, shape):
    return helper.make_tensor_value_info(name, T.FLOAT, shape)


def matmul_bias_relu():
    """Edges on every side (37 rows, 45 columns, K = 70 are not multiples of 16) and a batch."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    return make_model(nodes, [_info("x", [2, 37, 70])], [_info("y", [2, 37, 45])],
                      [_weight("w", (70, 45)), _weight("b", (45,))])


def padded_conv():
    """An implicit GEMM whose operand is computed (padding), so it is staged without async copies."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])]
    return make_model(nodes, [_info("x", [1, 8, 9, 9])], [_info("y", [1, 24, 9, 9])], [_weight("w", (24, 8, 3, 3))])


def _close(got, want, precision):
    scale = float(np.abs(want).max())
    error = float(np.abs(got - want).max())
    assert error <= TOLERANCE[precision] * scale, f"{precision}: max error {error:g} vs max |y| {scale:g}"
    return error


@pytest.mark.parametrize("precision", ["tf32", "fp16", "bf16"])
def test_matmul_on_tensor_cores_matches_onnxruntime_within_its_precision(precision):
    model = matmul_bias_relu()
    feeds = {"x": RNG.standard_normal((2, 37, 70)).astype(np.float32)}
    want = run_onnxruntime(model, feeds)["y"]
    got, source = run_cuda_sim(model, feeds, seed=3, with_source=True, precision=precision)
    assert "wmma::mma_sync(acc_frag[i][j], a_frag[i], b_frag[j], acc_frag[i][j])" in source
    assert f"wmma::fragment<wmma::matrix_a, 16, 16, {KSTEP[precision]}" in source
    assert "__pipeline_memcpy_async" in source and "__pipeline_wait_prior(" in source
    assert "Relu" in source.split("tensor cores")[1].splitlines()[0]    # the epilogue stayed fused
    error = _close(got["y"], want, precision)
    assert error > 0, "rounded inputs give other numbers than float32 FMA"
    exact = run_cuda_sim(model, feeds)["y"]
    assert not np.array_equal(exact, got["y"])


def test_conv_as_implicit_gemm_on_tensor_cores_matches_onnxruntime():
    model = padded_conv()
    feeds = {"x": RNG.standard_normal((1, 8, 9, 9)).astype(np.float32)}
    got, source = run_cuda_sim(model, feeds, seed=5, with_source=True, precision="tf32")
    assert "tensor cores (tf32" in source and "wmma::__float_to_tf32" in source
    _close(got["y"], run_onnxruntime(model, feeds)["y"], "tf32")


def test_small_contractions_keep_the_exact_kernel():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    model = make_model(nodes, [_info("x", [8, 20])], [_info("y", [8, 20])], [_weight("w", (20, 20))])
    feeds = {"x": RNG.standard_normal((8, 20)).astype(np.float32)}
    got, source = run_cuda_sim(model, feeds, with_source=True, precision="fp16")
    assert "wmma" not in source
    np.testing.assert_allclose(got["y"], run_onnxruntime(model, feeds)["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_source_compiles_for_sm_80_and_sm_90_with_each_compiler_available():

    _, source = run_cuda_sim(matmul_bias_relu(), {"x": np.zeros((2, 37, 70), np.float32)}, with_source=True,
                             precision="bf16")
    compilers = [c for c, ok in (("nvcc", toolchain.find_nvcc()), ("nvrtc", toolchain.nvrtc_version())) if ok]
    if not compilers:
        pytest.skip("no CUDA compiler installed")
    for compiler in compilers:
        built = toolchain.compile_cuda(source, "cu.cu", ("sm_80", "sm_90"), compiler)
        assert set(built.cubins) == {"sm_80", "sm_90"} and not built.spilling_kernels()
        assert b"mma.sync" in built.ptx or b"wmma.mma" in built.ptx   # really tensor-core instructions


def _cli_pipeline(tmp_path, *compile_args):


    case = sample_model("mlp")
    cus, dag = tmp_path / "cus", tmp_path / "dag.json"
    assert run_cli(["decompose", "--model-path", case.path, "--output-dir", cus, "--dim", "batch=32"])[0] == 0
    assert run_cli(["build-dag", "--cu-dir", cus, "--output", dag])[0] == 0
    code, _, err = run_cli(["compile-cuda", "--cu-dir", cus, "--dag", dag, "--output", tmp_path / "cuda-bin",
                              "--arch", "sm_90", *compile_args])
    return case, dag, code, err


@pytest.mark.slow
def test_cli_precision_is_recorded_per_cu_and_runs_on_cuda_sim(tmp_path):



    case, dag, code, err = _cli_pipeline(tmp_path, "--precision", "tf32")
    assert code == 0, err
    record = json.loads(dag.read_text())
    validate_dag(record)
    precisions = [cu["artifacts"]["cuda"]["precision"] for cu in record["cus"]]
    assert all(p["requested"] == "tf32" for p in precisions)
    assert any("tf32" in p["tensor_cores"].values() for p in precisions)
    x = RNG.standard_normal((32, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code, _, err = run_cli(["run", dag, "--device", "cuda-sim", "--input", f"x={tmp_path / 'x.npy'}",
                            "--output", tmp_path / "y.npz"])
    assert code == 0, err
    session = ort.InferenceSession(str(case.path), providers=["CPUExecutionProvider"])
    want = session.run(None, {"x": x})[0]
    with np.load(tmp_path / "y.npz") as got:
        _close(next(iter(got.values())), want, "tf32")


def test_cli_precision_mistakes_are_one_line(tmp_path):

    code, _, err = run_cli(["compile-cuda", "--cu-dir", tmp_path, "--output", tmp_path / "o", "--precision", "fp8"])
    assert_one_line_error(code, err, "--precision")
    _, _, code, err = _cli_pipeline(tmp_path, "--precision", "bf16", "--arch", "sm_75")
    assert_one_line_error(code, err, "--precision bf16", "sm_75")
    assert not (tmp_path / "cuda-bin").exists()


def test_an_fp16_weights_variant_runs_its_contraction_on_fp16_tensor_cores():

    graph, _ = run_pipeline(import_model(matmul_bias_relu()), optimize_pipeline(require_static=True))
    assert stored_weight_precision(graph) == "exact"
    variant = narrowed(graph, "fp16")
    assert stored_weight_precision(variant) == "fp16"
    options = CudaOptions(arch=("sm_90",), compiler="nvrtc")
    record = build_cu(variant, options, "cu-0000-fp16").record
    assert record["precision"]["requested"] == "fp16" and "fp16" in record["precision"]["tensor_cores"].values()
    assert "precision" not in build_cu(graph, options, "cu-0000").record
    older = build_cu(variant, CudaOptions(arch=("sm_75",), compiler="nvrtc"), "cu-0000-fp16").record
    assert "precision" not in older     # no tensor cores to use there


@pytest.mark.slow
def test_fp16_variants_calibrate_with_their_tensor_cores_and_run_on_cuda_sim(tmp_path):



    case = sample_model("mlp")
    cus, dag = tmp_path / "cus", tmp_path / "dag.json"
    assert run_cli(["decompose", "--model-path", case.path, "--output-dir", cus, "--dim", "batch=32",
                    "--min-cu-size", "16", "--max-cu-depth", "1"])[0] == 0
    assert run_cli(["build-dag", "--cu-dir", cus, "--output", dag])[0] == 0
    code, _, err = run_cli(["compile-cuda", "--cu-dir", cus, "--dag", dag, "--output", tmp_path / "cuda-bin",
                            "--compiler", "nvrtc", "--arch", "sm_90", "--variants", "fp16"])
    assert code == 0, err
    data = RNG.standard_normal((4, 32, 64)).astype(np.float32)
    np.savez(tmp_path / "feeds.npz", x=data)
    code, _, err = run_cli(["calibrate", dag, "--data", tmp_path / "feeds.npz", "--device", "cuda-sim"])
    assert code == 0, err
    record = json.loads(dag.read_text())
    variants = [cu["variants"]["fp16"] for cu in record["cus"] if cu.get("variants")]
    on_tensor_cores = [v for v in variants if v["artifacts"]["cuda"].get("precision", {}).get("tensor_cores")]
    assert on_tensor_cores and all(v["trust"] is not None for v in variants)
    x = RNG.standard_normal((32, 64)).astype(np.float32)
    exact = cortex.load(dag, device="cuda-sim", policy="strict").run({"x": x})
    model = cortex.load(dag, device="cuda-sim", policy="aggressive")
    got = model.run({"x": x})
    assert model.last_trace["approximated_cus"]
    for name, value in exact.items():
        _close(got[name], value, "fp16")


SANITIZED_TENSOR_CORES = """
import functools, sys
import numpy as np
sys.path.insert(0, "tests")
from backends.cuda import runner
from backends.cuda.sim import SimModule
runner.SimModule = functools.partial(SimModule, sanitize=True)
from cuda_cases import run_cuda_sim
from test_cuda_tensor_cores import matmul_bias_relu, padded_conv
from wasm_cases import run_onnxruntime
rng = np.random.default_rng(0)
for model, shape in ((matmul_bias_relu(), (2, 37, 70)), (padded_conv(), (1, 8, 9, 9))):
    feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
    got = run_cuda_sim(model, feeds, seed=7, precision=sys.argv[1])["y"]
    want = run_onnxruntime(model, feeds)["y"]
    print("error", float(np.abs(got - want).max() / np.abs(want).max()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_tensor_core_kernels_stay_in_bounds_under_asan(precision):
    """The staging loops of edge tiles (rows, columns and K not multiples of 16) read and write
    nothing outside their buffers: AddressSanitizer and UBSan watch every access."""


    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", SANITIZED_TENSOR_CORES, precision], cwd=root, capture_output=True,
                         text=True, env={**sanitizer_env(), "PYTHONPATH": str(root)}, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = [float(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("error")]
    assert len(errors) == 2 and max(errors) < TOLERANCE[precision]


def _optimized(model):

    return run_pipeline(import_model(model), optimize_pipeline(require_static=True))[0]


def test_a_tf32_variant_keeps_the_float32_weights_and_puts_the_contraction_on_tensor_cores():

    graph, options = _optimized(matmul_bias_relu()), CudaOptions(arch=("sm_90",), compiler="nvrtc")
    exact, variant = build_cu(graph, options, "cu-0000"), build_tf32_variant(graph, options, "cu-0000-tf32")
    assert "precision" not in exact.record
    assert variant.record["precision"]["requested"] == "tf32"
    assert list(variant.record["precision"]["tensor_cores"].values()) == ["tf32"]
    source = variant.files[variant.record["source"]["file"]].decode()
    assert "wmma::__float_to_tf32" in source and "wmma::" not in exact.files[exact.record["source"]["file"]].decode()
    # The exact bytes: the same weights blob, and so the same size `chosen_variant` compares.
    assert variant.files[variant.record["weights"]["file"]] == exact.files[exact.record["weights"]["file"]]
    small = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [_info("x", [8, 20])], [_info("y", [8, 20])],
                       [_weight("w", (20, 20))])
    assert build_tf32_variant(_optimized(small), options, "cu-0000-tf32") is None   # nothing tf32 would change


def test_tf32_variants_run_only_where_no_more_compact_one_passes():

    def cu(**variants):
        return {"variants": {p: {"trust": trust, "artifacts": {"cuda": {"weights": {"bytes": size}}}}
                             for p, (trust, size) in variants.items()}}

    both = cu(fp16=(0.995, 100), tf32=(0.9999, 200))
    assert chosen_variant(both, "cuda", 0.99) == "fp16"       # fewer bytes first, though tf32 is closer
    assert chosen_variant(both, "cuda", 0.999) == "tf32"      # the narrow one does not pass, tf32 does
    assert chosen_variant(both, "cuda", None) is None         # strict: never
    assert chosen_variant(cu(tf32=(0.99, 200), int8=(0.99, 200)), "cuda", 0.95) == "int8"   # ties by name
    assert chosen_variant(cu(tf32=(None, 200)), "cuda", 0.0) is None                        # never calibrated
    assert chosen_variant(both, "wasm", 0.9) is None          # no wasm artifacts: nothing to run there


def test_tf32_variant_mistakes_are_one_line(tmp_path):
    """Before any work, nothing written: tf32 is a compile-cuda variant (compile-wasm and cortex build's
    --wasm-variants refuse it by name), needs sm_80, and needs exact CUs to vary from."""


    out = tmp_path / "o"
    code, _, err = run_cli(["compile-wasm", "--cu-dir", tmp_path, "--output", out, "--variants", "fp16,tf32"])
    assert_one_line_error(code, err, "--variants tf32", "compile-cuda", "fp16,bf16,int8")
    code, _, err = run_cli(["build", sample_model("mlp").path, "--output", out, "--targets", "wasm,cuda",
                            "--dim", "batch=32", "--wasm-variants", "tf32", "--cuda-variants", "fp16,tf32"])
    assert_one_line_error(code, err, "--wasm-variants tf32", "compile-cuda")
    cuda = targets()["cuda"]
    for changes, variants, message in (({"arch": ("sm_75", "sm_90")}, "tf32", "--variants tf32 needs tensor cores.*sm_75"),
                                       ({"precision": "tf32"}, "tf32", "--variants tf32 .*--precision tf32"),
                                       ({}, "tf32,fp8", "unknown --variants fp8: .*fp16,bf16,int8,tf32$")):
        options = cuda.options(compiler="nvrtc", **changes)
        with pytest.raises(CortexError, match=message):
            compile_cu_dir(cuda, tmp_path, out, options, variants=variants)
    assert not out.exists()


@pytest.mark.slow
def test_tf32_variants_build_for_cuda_calibrate_and_run_under_aggressive_on_cuda_sim(tmp_path):
    """One `cortex build --targets wasm,cuda` with fp16 for wasm and tf32 for cuda: only the CUs with a
    tensor-core contraction get a tf32 variant, cuda-sim calibrates it (wasm leaves it alone), and
    aggressive runs it within tf32's error of onnxruntime while strict runs the exact CUs."""




    case, out = sample_model("mlp"), tmp_path / "out"
    code, _, err = run_cli(["build", case.path, "--output", out, "--targets", "cuda", "--dim", "batch=32",
                            "--cuda-variants", "tf32", "--cuda-arch", "sm_75"])
    assert_one_line_error(code, err, "--cuda-variants tf32", "--cuda-arch has sm_75")
    assert not out.exists()
    build = ["build", case.path, "--output", out, "--targets", "wasm,cuda", "--dim", "batch=32",
             "--min-cu-size", "16", "--max-cu-depth", "1", "--wasm-variants", "fp16", "--cuda-variants", "tf32",
             "--cuda-compiler", "nvrtc", "--cuda-arch", "sm_90", "--json"]
    code, printed, err = run_cli(build)
    assert code == 0, err
    assert json.loads(printed)["compile"]["cuda"]["variant_bytes"]["tf32"] > 0
    dag = out / "dag.json"
    record = json.loads(dag.read_text())
    validate_dag(record)
    with_tf32 = {cu["id"]: cu["variants"]["tf32"] for cu in record["cus"] if "tf32" in cu.get("variants", {})}
    assert 0 < len(with_tf32) < len(record["cus"])     # the last CU's N = 10 is under a tile: no variant
    for cu in record["cus"]:
        assert set(cu["variants"]) == ({"fp16", "tf32"} if cu["id"] in with_tf32 else {"fp16"})
        assert set(cu["variants"]["fp16"]["artifacts"]) == {"wasm"}
    for variant in with_tf32.values():
        assert set(variant["artifacts"]) == {"cuda"} and variant["trust"] is None
        assert set(variant["artifacts"]["cuda"]["precision"]["tensor_cores"].values()) == {"tf32"}
    code, printed, err = run_cli(build)
    assert code == 0, err
    assert json.loads(printed)["compiled_cus"] == 0      # every CU and variant from the compile cache

    data = RNG.standard_normal((3, 32, 64)).astype(np.float32)
    np.savez(tmp_path / "feeds.npz", x=data)
    code, _, err = run_cli(["calibrate", dag, "--data", tmp_path / "feeds.npz", "--device", "cuda-sim"])
    assert code == 0, err
    calibrated = {cu["id"]: cu["variants"] for cu in json.loads(dag.read_text())["cus"]}
    for cu_id in with_tf32:
        assert calibrated[cu_id]["tf32"]["trust"] > 0.99 and calibrated[cu_id]["tf32"]["device"] == "cuda-sim"
        assert calibrated[cu_id]["fp16"]["trust"] is None      # no cuda artifact: not measured here
    code, _, err = run_cli(["calibrate", dag, "--data", tmp_path / "feeds.npz", "--device", "wasm"])
    assert code == 0, err
    again = {cu["id"]: cu["variants"] for cu in json.loads(dag.read_text())["cus"]}
    for cu_id in with_tf32:
        assert again[cu_id]["tf32"] == calibrated[cu_id]["tf32"]     # wasm cannot run it: left as it was
        assert again[cu_id]["fp16"]["trust"] > 0.99

    x = RNG.standard_normal((32, 64)).astype(np.float32)
    want = run_onnxruntime(onnx.load(case.path), {"x": x})
    strict = cortex.load(dag, device="cuda-sim", policy="strict")
    exact = strict.run({"x": x})
    assert strict.last_trace["approximated_cus"] == []
    model = cortex.load(dag, device="cuda-sim", policy="aggressive")
    got = model.run({"x": x})
    assert {(e["cu"], e["precision"]) for e in model.last_trace["approximated_cus"]} == {(c, "tf32") for c in with_tf32}
    for name, value in want.items():
        np.testing.assert_allclose(exact[name], value, rtol=1e-5, atol=1e-5)
        _close(got[name], value, "tf32")
        assert not np.array_equal(got[name], exact[name])     # really the tensor cores' rounding
