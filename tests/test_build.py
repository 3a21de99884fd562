"""`cortex build`: the same artifacts as decompose + build-dag + compile-<target>, byte for byte; an
unchanged rebuild compiles nothing; a one-CU change recompiles one CU; `--check` names what is stale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import assert_one_line_error, run_cli
from cuda_cases import cuda_compiler_available
from onnx import numpy_helper
from testdata import SAMPLES_DIR

from samples.light_models import LIGHT_DIR, LIGHT_MODEL_NAMES

# decompose options binding each committed sample's dynamic dims (tests/testdata.py SAMPLE_DIMS)
SAMPLE_OPTIONS = {"mlp": ["--dim", "batch=2"], "cnn": ["--max-cu-size", "3000"],
                  "transformer_block": ["--dim", "seq=16"]}


def tree(folder: Path, skip=("build.json",)) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in skip}


def four_commands(model: str, out: str, decompose_options: list[str], targets: list[str], cwd: Path) -> None:
    steps = [["decompose", "--model-path", model, "--output-dir", f"{out}/cus", *decompose_options],
             ["build-dag", "--cu-dir", f"{out}/cus", "--output", f"{out}/dag.json"],
             *(["compile-" + t, "--cu-dir", f"{out}/cus", "--output", f"{out}/{t}-bin", "--dag", f"{out}/dag.json",
                "--no-cache"] for t in targets)]
    for argv in steps:
        code, _, err = run_cli(argv, cwd=cwd)
        assert code == 0, err


def build(cwd: Path, model: str, out: str, *options: str, check_code: int = 0) -> dict:
    code, stdout, err = run_cli(["build", model, "--output", out, "--json", *options], cwd=cwd)
    assert code == check_code, err
    return json.loads(stdout)


def assert_build_matches_four_commands(tmp_path: Path, source: Path, options: list[str], targets: list[str]):
    shutil.copy(source, tmp_path / "model.onnx")
    four_commands("model.onnx", "four", options, targets, tmp_path)
    summary = build(tmp_path, "model.onnx", "built", "--targets", ",".join(targets),
                    "--cache-dir", "cache", *options)
    assert summary["compiled_cus"] == summary["cus"] * len(targets)
    expected, built = tree(tmp_path / "four"), tree(tmp_path / "built")
    assert sorted(built) == sorted(expected)
    assert [name for name in expected if built[name] != expected[name]] == []
    assert (tmp_path / "built" / "build.json").is_file()


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n != "mlp" else [])
                                  for n in SAMPLE_OPTIONS])
def test_build_matches_the_four_commands_byte_for_byte(tmp_path, name):
    assert_build_matches_four_commands(tmp_path, SAMPLES_DIR / f"{name}.onnx", SAMPLE_OPTIONS[name], ["wasm"])


@pytest.mark.slow
@pytest.mark.skipif(not cuda_compiler_available(), reason="no CUDA compiler (nvcc or NVRTC)")
def test_build_for_wasm_and_cuda_matches_the_five_commands(tmp_path):
    assert_build_matches_four_commands(tmp_path, SAMPLES_DIR / "mlp.onnx", SAMPLE_OPTIONS["mlp"], ["wasm", "cuda"])


@pytest.mark.slow
@pytest.mark.parametrize("name", LIGHT_MODEL_NAMES)
def test_build_matches_the_four_commands_on_light_models(tmp_path, name):
    assert_build_matches_four_commands(tmp_path, LIGHT_DIR / f"light_{name}.onnx", [], ["wasm"])


def test_a_second_build_with_nothing_changed_compiles_nothing(tmp_path):
    shutil.copy(SAMPLES_DIR / "cnn.onnx", tmp_path / "model.onnx")
    first = build(tmp_path, "model.onnx", "out", "--cache-dir", "cache", *SAMPLE_OPTIONS["cnn"])
    before = tree(tmp_path / "out", skip=())
    second = build(tmp_path, "model.onnx", "out", "--cache-dir", "cache", *SAMPLE_OPTIONS["cnn"])
    assert first["cus"] == second["cus"] > 1
    assert (second["compiled_cus"], second["reused_cus"]) == (0, first["cus"])
    assert tree(tmp_path / "out", skip=()) == before
    assert second["compile"]["wasm"]["output"] == "out/wasm-bin" and ".build" not in json.dumps(second)


def with_one_weight_changed(source: Path, destination: Path, weight: str) -> None:
    model = onnx.load(source)
    for i, tensor in enumerate(model.graph.initializer):
        if tensor.name == weight:
            changed = numpy_helper.to_array(tensor).copy()
            changed.flat[0] += np.float32(0.5)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(changed, weight))
    onnx.save(model, destination)


def test_after_a_one_cu_change_only_that_cu_is_recompiled(tmp_path):
    shutil.copy(SAMPLES_DIR / "cnn.onnx", tmp_path / "model.onnx")
    options = ["--cache-dir", "cache", *SAMPLE_OPTIONS["cnn"]]
    first = build(tmp_path, "model.onnx", "out", *options)
    with_one_weight_changed(SAMPLES_DIR / "cnn.onnx", tmp_path / "model.onnx", "res_b.0.weight")
    second = build(tmp_path, "model.onnx", "out", *options)
    assert (second["compiled_cus"], second["reused_cus"]) == (1, first["cus"] - 1)
    # the incremental result is exactly a clean build's
    build(tmp_path, "model.onnx", "clean", "--no-cache", *SAMPLE_OPTIONS["cnn"])
    assert tree(tmp_path / "out") == tree(tmp_path / "clean")


@pytest.mark.slow
def test_changing_a_target_option_recompiles_that_target_only(tmp_path):
    shutil.copy(SAMPLES_DIR / "mlp.onnx", tmp_path / "model.onnx")
    build(tmp_path, "model.onnx", "out", "--cache-dir", "cache", "--dim", "batch=1")
    changed = build(tmp_path, "model.onnx", "out", "--cache-dir", "cache", "--dim", "batch=1",
                    "--wasm-opt-level", "3")
    assert changed["compile"]["wasm"]["compiled_cus"] == changed["cus"]
    assert json.loads((tmp_path / "out" / "wasm-bin" / "index.json").read_text())["options"]["opt_level"] == "3"


def check(cwd: Path, *options: str) -> tuple[int, str, str]:
    return run_cli(["build", "model.onnx", "--output", "out", "--check", *options], cwd=cwd)


def test_check_passes_on_a_fresh_build_and_fails_on_a_changed_option_or_artifact(tmp_path):
    shutil.copy(SAMPLES_DIR / "mlp.onnx", tmp_path / "model.onnx")
    options = ["--dim", "batch=1", "--cache-dir", "cache"]
    build(tmp_path, "model.onnx", "out", *options)
    code, stdout, err = check(tmp_path, *options)
    assert (code, err) == (0, "") and "out is up to date" in stdout
    assert_one_line_error(*check(tmp_path, *options, "--wasm-opt-level", "3")[::2], "--wasm-opt-level",
                          "built with 2, now 3", exit_code=1)
    (tmp_path / "out" / "dag.json").write_text("{}")
    assert_one_line_error(*check(tmp_path, *options)[::2], "dag.json", "changed", exit_code=1)


@pytest.mark.slow
def test_check_names_what_made_the_output_stale_and_writes_nothing(tmp_path):
    shutil.copy(SAMPLES_DIR / "cnn.onnx", tmp_path / "model.onnx")
    options = [*SAMPLE_OPTIONS["cnn"], "--cache-dir", "cache"]
    code, _, err = check(tmp_path, *options)
    assert_one_line_error(code, err, "no build.json", exit_code=1)
    build(tmp_path, "model.onnx", "out", *options)
    snapshot = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}

    code, stdout, err = check(tmp_path, *options)
    assert (code, err) == (0, "") and "up to date" in stdout
    assert_one_line_error(*check(tmp_path, *options, "--max-cu-depth", "2")[::2], "--max-cu-depth", "built with 3",
                          exit_code=1)
    assert_one_line_error(*check(tmp_path, *options, "--wasm-features", "simd,bulk-memory")[::2],
                          "--wasm-features", exit_code=1)
    assert_one_line_error(*check(tmp_path, *options, "--targets", "wasm,cuda")[::2], "--targets", exit_code=1)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == snapshot   # --check wrote nothing

    code, stdout, _ = check(tmp_path, *options, "--json", "--wasm-opt-level", "3")
    assert code == 1 and json.loads(stdout)["up_to_date"] is False

    module = tmp_path / "out" / "wasm-bin" / "cu-0001.wasm"
    data = module.read_bytes()
    module.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert_one_line_error(*check(tmp_path, *options)[::2], "cu-0001.wasm", "changed", exit_code=1)
    module.unlink()
    assert_one_line_error(*check(tmp_path, *options)[::2], "cu-0001.wasm", "missing", exit_code=1)

    with_one_weight_changed(SAMPLES_DIR / "cnn.onnx", tmp_path / "model.onnx", "res_b.0.weight")
    assert_one_line_error(*check(tmp_path, *options)[::2], "model.onnx changed", exit_code=1)


@pytest.mark.slow
def test_check_sees_a_changed_file_that_an_option_names(tmp_path):
    shutil.copy(SAMPLES_DIR / "mlp.onnx", tmp_path / "model.onnx")
    np.save(tmp_path / "x.npy", np.ones((1, 64), np.float32))
    options = ["--freeze-input", "x=x.npy", "--cache-dir", "cache"]
    build(tmp_path, "model.onnx", "out", *options)
    assert check(tmp_path, *options)[0] == 0
    np.save(tmp_path / "x.npy", np.zeros((1, 64), np.float32))
    assert_one_line_error(*check(tmp_path, *options)[::2], "x=x.npy", exit_code=1)


@pytest.mark.slow
def test_bad_build_options_are_one_line_and_leave_the_output_as_it_was(tmp_path):
    shutil.copy(SAMPLES_DIR / "mlp.onnx", tmp_path / "model.onnx")
    build(tmp_path, "model.onnx", "out", "--dim", "batch=1", "--cache-dir", "cache")
    (tmp_path / "out" / "notes.txt").write_text("kept")
    before = tree(tmp_path / "out", skip=())
    for argv, fragment in [(["--targets", "wasm,vulkan"], "--targets"),
                           (["--wasm-opt-level", "9"], "--wasm-opt-level"),
                           (["--cache-max-mb", "0"], "--cache-max-mb"),
                           ([], "--dim batch=N")]:           # the model's dim left unbound: decompose fails
        code, _, err = run_cli(["build", "model.onnx", "--output", "out", "--cache-dir", "cache", *argv], cwd=tmp_path)
        assert_one_line_error(code, err, fragment)
        assert ".build" not in err
    assert tree(tmp_path / "out", skip=()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "model.onnx", "out"]   # no staging left
    code, _, err = run_cli(["build", "missing.onnx", "--output", "out"], cwd=tmp_path)
    assert_one_line_error(code, err, "missing.onnx")
    code, _, err = run_cli(["build", "model.onnx", "--output", "model.onnx", "--dim", "batch=1"], cwd=tmp_path)
    assert_one_line_error(code, err, "--output model.onnx")


@pytest.mark.slow
def test_a_later_build_keeps_other_files_and_drops_targets_no_longer_built(tmp_path):
    if not cuda_compiler_available():
        pytest.skip("no CUDA compiler (nvcc or NVRTC)")
    shutil.copy(SAMPLES_DIR / "mlp.onnx", tmp_path / "model.onnx")
    build(tmp_path, "model.onnx", "out", "--dim", "batch=1", "--targets", "wasm,cuda", "--cache-dir", "cache")
    (tmp_path / "out" / "notes.txt").write_text("kept")
    build(tmp_path, "model.onnx", "out", "--dim", "batch=1", "--cache-dir", "cache")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["build.json", "cus", "dag.json", "notes.txt",
                                                                   "wasm-bin"]


@pytest.mark.slow
def test_build_prints_a_summary_with_the_reuse_count(tmp_path):
    shutil.copy(SAMPLES_DIR / "mlp.onnx", tmp_path / "model.onnx")
    for expected in ("1 / 0", "0 / 1"):
        code, stdout, err = run_cli(["build", "model.onnx", "--output", "out", "--dim", "batch=1",
                                     "--cache-dir", "cache"], cwd=tmp_path)
        assert code == 0, err
        assert "wasm: compiled / reused CUs" in stdout and expected in stdout
