"""Whole models through decompose -> build-dag -> compile-cuda -> cortex.load(device="cuda-sim"):
the generated CUDA compiles with nvcc and with NVRTC to PTX and sm_80/sm_90 cubins without spills,
and, run unchanged on the CPU under cuda-sim, matches onnxruntime."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

import cortex
from backends.cuda import toolchain as cuda_compile
from backends.cuda.toolchain import CudaCompileError
from backends.cuda.build import CudaOptions
from cli_helpers import cortex_command
from backends.cuda.runner import CuRunner
from backends.registry import target
from cortex.compile import compile_cu_dir
from cortex.dag import validate_dag
from cuda_cases import check_each_cu_against_onnxruntime, compile_cuda_pipeline
from testdata import LIGHT_MODEL_NAMES, SAMPLE_NAMES, assert_values_close, light_model, minilm, sample_model

RTOL, ATOL = 1e-4, 1e-5
needs_nvcc = pytest.mark.skipif(cuda_compile.find_nvcc() is None, reason="nvcc not installed")
needs_nvrtc = pytest.mark.skipif(cuda_compile.nvrtc_version() is None, reason="NVRTC not installed")


def check_on_cuda_sim(case, dag_path):
    got = cortex.load(dag_path, device="cuda-sim").run(case.inputs)
    assert sorted(got) == sorted(case.outputs)
    for name, want in case.outputs.items():
        assert got[name].dtype == np.asarray(want).dtype
        assert_values_close(got[name], want, rtol=RTOL, atol=ATOL)


def assert_compiled_for_both_archs_without_spills(dag_path, compiler_prefix):
    dag = json.loads(dag_path.read_text())
    validate_dag(dag)
    for cu in dag["cus"]:
        record = cu["artifacts"]["cuda"]
        assert record["compiler"].startswith(compiler_prefix)
        assert set(record["cubins"]) == {"sm_80", "sm_90"} and record["ptx"]["arch"] == "compute_80"
        assert record["spills"] == []
        kernels = {launch["kernel"] for launch in record["launches"]}
        for arch in ("sm_80", "sm_90"):
            assert set(record["resources"][arch]) == kernels
            assert all(0 < r["registers"] <= 255 and r["spill_store_bytes"] == 0 for r in record["resources"][arch].values())
        for launch in record["launches"]:
            assert _count(launch["grid"]) * _count(launch["block"]) >= launch["threads"] >= 1


def _count(dims) -> int:
    return int(np.prod(dims)) if isinstance(dims, list) else dims


@needs_nvcc
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_samples_match_onnxruntime_on_cuda_sim(name, tmp_path):
    case = sample_model(name)
    dag_path = compile_cuda_pipeline(case, tmp_path, "nvcc", min_cu_size=64, max_cu_depth=3)
    assert_compiled_for_both_archs_without_spills(dag_path, "nvcc")
    check_on_cuda_sim(case, dag_path)


@needs_nvrtc
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "transformer_block" else [pytest.mark.slow])
                                  for n in SAMPLE_NAMES])
def test_samples_compile_with_nvrtc_too(name, tmp_path):
    case = sample_model(name)
    dag_path = compile_cuda_pipeline(case, tmp_path, "nvrtc", min_cu_size=64, max_cu_depth=3)
    assert_compiled_for_both_archs_without_spills(dag_path, "nvrtc")


@needs_nvcc
def test_contractions_run_one_thread_per_output_element(tmp_path):
    """The renderer proves the output loops of MatMul/Gemm/Conv independent and maps them to threads;
    only the reduction stays a loop inside each thread."""
    case = sample_model("cnn")
    dag = json.loads(compile_cuda_pipeline(case, tmp_path, "nvcc").read_text())
    launches = [launch for cu in dag["cus"] for launch in cu["artifacts"]["cuda"]["launches"]]
    for launch in launches:
        if launch["op_type"] in ("Conv", "Gemm", "MatMul"):
            assert launch["threads"] > 1 and _count(launch["block"]) > 1, launch
    assert sum(1 for launch in launches if launch["threads"] == 1) == 0


@needs_nvcc
def test_generated_kernels_have_no_races_under_permuted_order(tmp_path):
    case = sample_model("transformer_block")
    dag_path = compile_cuda_pipeline(case, tmp_path, "nvcc", min_cu_size=64, max_cu_depth=3)
    dag = json.loads(dag_path.read_text())
    env = dict(case.inputs)
    for cu_id in dag["order"]:
        cu = next(c for c in dag["cus"] if c["id"] == cu_id)
        record = cu["artifacts"]["cuda"]
        program = CuRunner(None, record, dag_path.parent / record["folder"], seed=12345, host_threads=2)
        env.update({k: v.copy() for k, v in program.run({n: env[n] for n in cu["inputs"]}).items()})
    for name, want in case.outputs.items():
        assert_values_close(env[name], want, rtol=RTOL, atol=ATOL)


@needs_nvcc
def test_compile_cuda_is_deterministic(tmp_path):
    case = sample_model("mlp")
    first = compile_cuda_pipeline(case, tmp_path / "a", "nvcc").parent / "cuda-bin"
    second = compile_cuda_pipeline(case, tmp_path / "b", "nvcc").parent / "cuda-bin"
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and any(n.endswith(".cubin") for n in names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@needs_nvcc
def test_a_failed_compile_leaves_the_output_folder_as_it_was(tmp_path):
    case = sample_model("mlp")
    output = tmp_path / "cuda-bin"
    output.mkdir()
    (output / "keep.txt").write_text("before")
    compile_cuda_pipeline(case, tmp_path, "nvcc")   # a good build first: the folder then holds it
    before = {p.name: p.read_bytes() for p in output.iterdir()}
    with pytest.raises(CudaCompileError, match="cu-0000"):
        compile_cu_dir(target("cuda"), tmp_path / "cus", output, CudaOptions(("sm_80", "sm_5"), "nvcc"),
                       tmp_path / "dag.json")
    assert {p.name: p.read_bytes() for p in output.iterdir()} == before


def _cli(*args):
    return subprocess.run(cortex_command(*args), capture_output=True, text=True, timeout=600)


def test_cli_mistakes_are_one_line_with_exit_code_2(tmp_path):
    bad_arch = _cli("compile-cuda", "--cu-dir", str(tmp_path), "--output", str(tmp_path / "o"), "--arch", "ampere")
    assert bad_arch.returncode == 2 and bad_arch.stderr.count("\n") == 1 and "not a CUDA architecture" in bad_arch.stderr
    bad_compiler = _cli("compile-cuda", "--cu-dir", str(tmp_path), "--output", str(tmp_path / "o"), "--compiler", "clang")
    assert bad_compiler.returncode == 2 and "unknown --compiler 'clang'" in bad_compiler.stderr
    assert not (tmp_path / "o").exists()


@needs_nvcc
def test_run_on_cuda_without_a_gpu_is_one_line(tmp_path):
    from backends.cuda.driver import CudaDeviceError, open_driver
    try:
        open_driver()
        pytest.skip("this machine has a CUDA driver")
    except CudaDeviceError:
        pass
    dag_path = compile_cuda_pipeline(sample_model("mlp"), tmp_path, "nvcc")
    run = _cli("run", str(dag_path), "--device", "cuda", "--example-inputs")
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "no CUDA driver" in run.stderr and "--device cuda-sim" in run.stderr


def _light_params():
    fast = ("squeezenet",)
    return [pytest.param(n, id=n, marks=[] if n in fast else [pytest.mark.slow])
            for n in LIGHT_MODEL_NAMES]


@needs_nvcc
@pytest.mark.parametrize("name", _light_params())
def test_light_models_match_onnxruntime_on_cuda_sim(name, tmp_path):
    case = light_model(name)
    dag_path = compile_cuda_pipeline(case, tmp_path, "nvcc")
    assert_compiled_for_both_archs_without_spills(dag_path, "nvcc")
    check_on_cuda_sim(case, dag_path)
    # Some light models end in a saturated softmax, so also compare every CU's own outputs.
    magnitudes = check_each_cu_against_onnxruntime(dag_path, case.inputs, RTOL, ATOL)
    assert max(magnitudes.values()) > 0.1   # the CUs compute something, not all zeros


@needs_nvcc
@pytest.mark.slow
def test_minilm_matches_onnxruntime_on_cuda_sim(tmp_path):
    case = minilm(batch=1, seq=128)
    dag_path = compile_cuda_pipeline(case, tmp_path, "nvcc")
    assert_compiled_for_both_archs_without_spills(dag_path, "nvcc")
    check_on_cuda_sim(case, dag_path)
    if cuda_compile.nvrtc_version():
        assert_compiled_for_both_archs_without_spills(compile_cuda_pipeline(case, tmp_path / "nvrtc", "nvrtc"), "nvrtc")


@needs_nvcc
def test_the_cli_compiles_and_runs_on_cuda_sim(tmp_path):
    case = sample_model("mlp")
    cus, dag, out = tmp_path / "cus", tmp_path / "dag.json", tmp_path / "y.npz"
    assert _cli("decompose", "--model-path", str(case.path), "--output-dir", str(cus), "--dim", "batch=2").returncode == 0
    assert _cli("build-dag", "--cu-dir", str(cus), "--output", str(dag)).returncode == 0
    compiled = _cli("compile-cuda", "--cu-dir", str(cus), "--dag", str(dag), "--output", str(tmp_path / "cuda-bin"),
                    "--compiler", "nvrtc", "--arch", "sm_90", "--json")
    assert compiled.returncode == 0, compiled.stderr
    summary = json.loads(compiled.stdout)
    assert summary["compiler"].startswith("nvrtc") and summary["archs"] == ["sm_90"] and summary["spills"] == []
    np.save(tmp_path / "x.npy", case.inputs["x"])
    ran = _cli("run", str(dag), "--device", "cuda-sim", "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out))
    assert ran.returncode == 0, ran.stderr
    with np.load(out) as got:
        assert_values_close(dict(got), case.outputs, rtol=RTOL, atol=ATOL)
