"""CUDA builds of shape specializations: one CU set per shape in one cuda-bin folder, every file
named by its content so the weights the shapes share are stored once, run on cuda-sim (the real
`cuda` device reads the same records) with the exact pick and --pad-to-bucket."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import numpy as np
import onnxruntime as ort
import pytest
from cli_helpers import assert_one_line_error, run_cli
from cuda_cases import cuda_compiler_available
from test_specializations import masked_attention_model

import cortex
from cortex.dag import dag_schema
from cortex.specializations import SCHEMA_FILE, section_dag
from ir.errors import CortexError

RTOL, ATOL = 1e-4, 1e-5
VOCAB = 8192       # weights (an 8192 x 16 embedding, 512 KiB) outweigh the code, as in real models
ARCH = ["--arch", "sm_80"]


pytestmark = pytest.mark.skipif(not cuda_compiler_available(), reason="no CUDA compiler (nvcc or NVRTC)")


def attention_model(path: Path) -> Path:
    return masked_attention_model(path, vocab=VOCAB)


def build(model: Path, out: Path, *shape_options: str, cache: Path | None = None) -> tuple[Path, dict]:
    """decompose -> build-dag -> compile-cuda through the installed script; dag.json and the
    compile summary."""
    cache_options = ["--cache-dir", cache] if cache is not None else ["--no-cache"]
    for argv in (["decompose", "--model-path", model, "--output-dir", out / "cus", "--min-cu-size", "64",
                  *shape_options],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    code, printed, err = run_cli(["compile-cuda", "--cu-dir", out / "cus", "--output", out / "cuda-bin",
                                  "--dag", out / "dag.json", *ARCH, *cache_options, "--json"])
    assert code == 0, err
    return out / "dag.json", json.loads(printed)


def feeds(seq: int, real: int | None = None) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seq).integers(0, VOCAB, (1, real or seq)).astype(np.int64)
    return {"ids": ids, "mask": np.ones_like(ids)}


def reference(model: Path, inputs: dict) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, inputs)[0]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def weight_files(section: dict) -> list[str]:
    return sorted(s["file"] for cu in section["cus"] for s in cu["artifacts"]["cuda"]["weights"]["segments"])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cuda-spec")
    model = attention_model(root / "attention.onnx")
    dag_path, _ = build(model, root / "spec", "--dim", "seq=8,16")
    return model, dag_path


def test_each_specialization_runs_on_cuda_sim_and_matches_onnxruntime(bundle):
    model, dag_path = bundle
    dag = json.loads(dag_path.read_text())
    assert dag["schema"] == "cortex.dag/2"
    for section in dag["specializations"]:
        jsonschema.validate(section_dag(section), dag_schema())
    jsonschema.validate(dag, json.loads(SCHEMA_FILE.read_text()))
    compiled = cortex.load(dag_path, device="cuda-sim")
    for seq in (8, 16):
        got = compiled.run(feeds(seq))["y"]
        assert compiled.specialization == f"seq={seq}" and got.shape == (1, seq, 16)
        np.testing.assert_allclose(got, reference(model, feeds(seq)), rtol=RTOL, atol=ATOL)


def test_the_shapes_share_one_copy_of_their_weights(bundle, tmp_path):
    model, dag_path = bundle
    dag = json.loads(dag_path.read_text())
    shared = [weight_files(s) for s in dag["specializations"]]
    assert shared[0] and shared[0] == shared[1]          # both shapes load the very same weight files
    stored = list((dag_path.parent / "cuda-bin" / "weights").iterdir())
    assert sorted(f"weights/{p.name}" for p in stored) == sorted(set(shared[0]))
    for section in dag["specializations"]:
        for cu in section["cus"]:
            record = cu["artifacts"]["cuda"]
            assert all(e["file"].startswith("modules/") for e in [record["source"], record["ptx"],
                                                                   *record["cubins"].values()] if e)
    single, _ = build(model, tmp_path / "single", "--dim", "seq=16")
    ratio = folder_bytes(dag_path.parent / "cuda-bin") / folder_bytes(single.parent / "cuda-bin")
    assert ratio <= 1.2, ratio


def test_a_shape_no_specialization_holds_is_one_line_and_pad_to_bucket_runs_it(bundle, tmp_path):
    model, dag_path = bundle
    short = feeds(8, real=5)
    for name, value in short.items():
        np.save(tmp_path / f"{name}.npy", value)
    inputs = [f"--input=ids={tmp_path / 'ids.npy'}", f"--input=mask={tmp_path / 'mask.npy'}"]
    code, _, err = run_cli(["run", dag_path, "--device", "cuda-sim", *inputs])
    assert_one_line_error(code, err, "no shape specialization matches", "ids=1x5", "seq=8", "seq=16")
    code, _, err = run_cli(["run", dag_path, "--device", "cuda-sim", *inputs, "--pad-to-bucket", "seq",
                            "--pad-value", "0", "--output", tmp_path / "y.npz"])
    assert code == 0, err
    got = np.load(tmp_path / "y.npz")["y"]
    assert got.shape == (1, 5, 16)
    np.testing.assert_allclose(got, reference(model, short), rtol=RTOL, atol=ATOL)
    padded = cortex.load(dag_path, device="cuda-sim", pad_to_bucket="seq")
    with pytest.raises(CortexError) as refused:
        padded.run(feeds(20))
    assert "ids=1x20" in str(refused.value) and "seq=16" in str(refused.value)


def test_a_modified_weight_file_is_refused_at_load_in_one_line(bundle, tmp_path):
    _, dag_path = bundle
    copy = tmp_path / "copy"
    shutil.copytree(dag_path.parent, copy)
    weight = min((copy / "cuda-bin" / "weights").iterdir())
    data = bytearray(weight.read_bytes())
    data[0] ^= 1
    weight.write_bytes(bytes(data))
    code, _, err = run_cli(["run", copy / "dag.json", "--device", "cuda-sim", "--example-inputs"])
    assert_one_line_error(code, err, weight.name, "sha256 differs")


def test_a_second_compile_takes_every_cu_from_the_cache_byte_for_byte(tmp_path):
    model = attention_model(tmp_path / "attention.onnx")
    dag_path, first = build(model, tmp_path / "out", "--dim", "seq=8,16", cache=tmp_path / "cache")
    files = {p.relative_to(tmp_path / "out").as_posix(): p.read_bytes()
             for p in sorted((tmp_path / "out").rglob("*")) if p.is_file()}
    code, printed, err = run_cli(["compile-cuda", "--cu-dir", tmp_path / "out" / "cus", "--output",
                                  tmp_path / "out" / "cuda-bin", "--dag", dag_path, *ARCH,
                                  "--cache-dir", tmp_path / "cache", "--json"])
    assert code == 0, err
    second = json.loads(printed)
    assert first["specializations"] == 2 and first["compiled_cus"] == first["cus"] > 2
    assert (second["compiled_cus"], second["reused_cus"]) == (0, first["cus"])
    assert second["bytes"] == first["bytes"]
    again = {p.relative_to(tmp_path / "out").as_posix(): p.read_bytes()
             for p in sorted((tmp_path / "out").rglob("*")) if p.is_file()}
    assert again == files


@pytest.mark.slow
def test_build_for_wasm_and_cuda_with_dims_matches_the_commands_and_checks_up_to_date(tmp_path):
    attention_model(tmp_path / "model.onnx")
    shapes = ["--dim", "seq=8,16", "--min-cu-size", "64"]
    for argv in (["decompose", "--model-path", "model.onnx", "--output-dir", "four/cus", *shapes],
                 ["build-dag", "--cu-dir", "four/cus", "--output", "four/dag.json"],
                 ["compile-wasm", "--cu-dir", "four/cus", "--output", "four/wasm-bin", "--dag", "four/dag.json",
                  "--no-cache"],
                 ["compile-cuda", "--cu-dir", "four/cus", "--output", "four/cuda-bin", "--dag", "four/dag.json",
                  "--no-cache"]):
        code, _, err = run_cli(argv, cwd=tmp_path)
        assert code == 0, err
    build_options = ["--targets", "wasm,cuda", "--cache-dir", "cache", *shapes]
    code, printed, err = run_cli(["build", "model.onnx", "--output", "built", "--json", *build_options], cwd=tmp_path)
    assert code == 0, err
    summary = json.loads(printed)
    assert summary["compile"]["cuda"]["specializations"] == 2
    expected = {p.relative_to(tmp_path / "four").as_posix(): p.read_bytes()
                for p in sorted((tmp_path / "four").rglob("*")) if p.is_file()}
    built = {p.relative_to(tmp_path / "built").as_posix(): p.read_bytes()
             for p in sorted((tmp_path / "built").rglob("*")) if p.is_file() and p.name != "build.json"}
    assert sorted(built) == sorted(expected)
    assert [name for name in expected if built[name] != expected[name]] == []
    code, printed, err = run_cli(["build", "model.onnx", "--output", "built", "--check", *build_options],
                                 cwd=tmp_path)
    assert code == 0 and "up to date" in printed, err
