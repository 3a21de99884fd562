"""The exit codes of the installed `cortex` script, as a CI job sees them: 0 success, 2 a user
mistake, 1 a failed check (verify), out of memory or a bug (one line each), 130 after SIGINT with
nothing written."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from numpy.lib import format as npy_format

from cli_helpers import assert_one_line_error, cortex_command, run_cli
from bench.bench_decompose import synthetic_model
from testdata import SAMPLES_DIR


def test_success_is_0(tmp_path):
    code, out, err = run_cli(["inspect", SAMPLES_DIR / "cnn.onnx", "--json"])
    assert code == 0, err
    assert json.loads(out)["source"]


def test_a_user_mistake_is_2(tmp_path):
    code, _, err = run_cli(["decompose", "--model-path", tmp_path / "missing.onnx", "--output-dir", tmp_path / "o"])
    assert_one_line_error(code, err, "missing.onnx")
    assert not (tmp_path / "o").exists()


def test_no_arguments_prints_help_and_is_2():
    code, _, err = run_cli([])
    assert code == 2 and "Usage" in err and "decompose" in err


def test_help_is_0():
    code, out, _ = run_cli(["verify", "--help"])
    assert code == 0 and "--rtol" in out


def test_a_verify_mismatch_is_1(tmp_path):
    model = SAMPLES_DIR / "transformer_block.onnx"
    for argv in (["decompose", "--model-path", model, "--output-dir", tmp_path / "cus", "--dim", "seq=16"],
                 ["build-dag", "--cu-dir", tmp_path / "cus", "--output", tmp_path / "dag.json"],
                 ["compile-wasm", "--cu-dir", tmp_path / "cus", "--dag", tmp_path / "dag.json",
                  "--output", tmp_path / "wasm"]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    code, out, err = run_cli(["verify", tmp_path / "dag.json", "--model", model, "--json"])
    assert code == 0, err
    # Softmax, LayerNorm and erf are not bit-identical to onnxruntime: a zero tolerance must fail.
    code, out, err = run_cli(["verify", tmp_path / "dag.json", "--model", model, "--rtol", "0", "--atol", "0", "--json"])
    report = json.loads(out)
    assert max(o["max_abs_error"] for o in report["outputs"]) > 0
    assert code == 1 and report["ok"] is False, err
    code, _, err = run_cli(["verify", tmp_path / "dag.json", "--model", model, "--atol", "-1"])
    assert_one_line_error(code, err, "--atol")


def test_sigint_during_decompose_is_130_and_writes_nothing(tmp_path):
    model, work = tmp_path / "model" / "big.onnx", tmp_path / "work"
    model.parent.mkdir()
    work.mkdir()
    onnx.save(synthetic_model(40_000), model)      # decompose takes well over 10 s on it
    process = subprocess.Popen(cortex_command("decompose", "--model-path", model, "--output-dir", work / "cus",
                                              "--json"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.5)
    assert process.poll() is None, "decompose ended before it could be interrupted"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert_one_line_error(process.returncode, err, "interrupted", exit_code=130)
    assert list(work.iterdir()) == [], "an interrupted decompose left files behind"


def _importing_numpy(pid: int) -> bool:
    """The process has mapped numpy's core extension: it is past the entry's handler, importing the CLI."""
    try:
        return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_sigint_while_starting_is_130_and_one_line(tmp_path):
    """Ctrl-C while the CLI is still importing (numpy, onnx, typer). Before the entry point's first
    line runs, the interpreter's own start-up owns the signal, so the test waits, a bounded time,
    until numpy is being loaded."""
    process = subprocess.Popen(cortex_command("inspect", SAMPLES_DIR / "cnn.onnx"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _importing_numpy(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    if process.returncode == 0:
        pytest.skip("inspect finished before the signal arrived")
    assert_one_line_error(process.returncode, err, "interrupted", exit_code=130)


FAULT = '''
import cortex.commands.inspect_model as target
def broken(*args, **kwargs):
    raise ZeroDivisionError("injected fault")
target.load_and_optimize = broken
'''


def test_an_unexpected_exception_is_1_and_one_line(tmp_path):
    """A bug (here a fault injected into the real process at startup) is one line, not a traceback."""
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    code, _, err = run_cli(["inspect", SAMPLES_DIR / "cnn.onnx"], env={"PYTHONPATH": str(tmp_path)})
    assert_one_line_error(code, err, "internal error", "ZeroDivisionError", "injected fault", exit_code=1)


def test_memory_error_is_1_and_one_line(tmp_path):
    """An input file whose header declares 364 TiB: numpy cannot allocate it."""
    path = tmp_path / "huge.npy"
    with open(path, "wb") as f:
        npy_format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (10**7, 10**7)})
        f.write(np.zeros(16, np.float32).tobytes())
    code, _, err = run_cli(["run", tmp_path / "dag.json", "--input", f"x={path}"])
    assert_one_line_error(code, err, "out of memory", exit_code=1)
