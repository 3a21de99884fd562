"""A dag.json may come from an artifact store or a CDN: `cortex run` checks it against the schema
and its invariants before anything runs, and answers each damaged field with one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run_cli
from testdata import SAMPLES_DIR


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cnn")
    model = SAMPLES_DIR / "cnn.onnx"
    for argv in (["decompose", "--model-path", model, "--output-dir", out / "cus"],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 ["compile-wasm", "--cu-dir", out / "cus", "--dag", out / "dag.json", "--output", out / "wasm-bin"]):
        code, _, err = run_cli(argv)
        assert code == 0, err
    np.save(out / "x.npy", np.ones((1, 3, 32, 32), np.float32))
    return out


def tampered(bundle: Path, tmp_path: Path, edit) -> Path:
    """A copy of the bundle whose dag.json went through `edit(dag)`."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy, symlinks=True)
    dag = json.loads((copy / "dag.json").read_text())
    edit(dag)
    (copy / "dag.json").write_text(json.dumps(dag))
    return copy


def _set(path: str, value):
    """An edit that sets one field, e.g. `cus.1.inputs.0`."""
    def edit(dag):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node = dag
        for p in parents:
            node = node[p]
        node[last] = value(node[last]) if callable(value) else value
    return edit


def _wasm(cu: int, rest: str, value):
    return _set(f"cus.{cu}.artifacts.wasm.{rest}", value)


EDITS = {
    "input-nothing-produces": (_set("cus.1.inputs.0", "ghost"), "'ghost'"),
    "reversed-order": (_set("order", lambda order: order[::-1]), "not topological"),
    "negative-dim": (_set("inputs.0.shape.1", -3), "schema"),
    "offset-past-memory": (_wasm(0, "memory.outputs.0.offset", 1 << 30), "past the module's"),
    "cus-is-a-string": (_set("cus", "cu-0000"), "schema at cus"),
    "unknown-dtype": (_set("inputs.0.dtype", "float33"), "unknown dtype 'float33'"),
    "huge-output": (_set("outputs.0.shape", [10**9, 10**9]), "would need"),
    "path-traversal": (_wasm(0, "path", "../../../../etc/passwd"), "leaves the folder"),
    "absolute-path": (_wasm(0, "path", "/etc/passwd"), "leaves the folder"),
    "order-misses-a-cu": (_set("order", lambda order: order[:-1]), "exactly once"),
    "wrong-sha256": (_wasm(0, "sha256", "0" * 64), "sha256 differs"),
    "memory-over-4-gib": (_wasm(0, "memory.memory_bytes", 1 << 40), "schema"),
    "plan-disagrees-with-tensor": (_wasm(0, "memory.inputs.0.shape", [1, 3, 16, 64]), "the tensor is"),
    "not-json": (None, "not readable JSON"),
}


@pytest.mark.parametrize("name", EDITS)
def test_a_damaged_dag_is_one_line_and_exit_2(bundle, tmp_path, name):
    edit, fragment = EDITS[name]
    if edit is None:
        copy = tmp_path / "bundle"
        shutil.copytree(bundle, copy)
        (copy / "dag.json").write_text("{not json")
    else:
        copy = tampered(bundle, tmp_path, edit)
    code, _, err = run_cli(["run", copy / "dag.json", "--input", f"x={bundle / 'x.npy'}"])
    assert_one_line_error(code, err, fragment)


def test_a_symlink_out_of_the_bundle_is_refused(bundle, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    copy = tampered(bundle, tmp_path, lambda dag: None)
    shutil.move(copy / "wasm-bin", outside / "wasm-bin")
    os.symlink(outside / "wasm-bin", copy / "wasm-bin")
    code, _, err = run_cli(["run", copy / "dag.json", "--input", f"x={bundle / 'x.npy'}"])
    assert_one_line_error(code, err, "leaves the folder")


def test_the_untouched_bundle_runs(bundle, tmp_path):
    code, _, err = run_cli(["run", bundle / "dag.json", "--input", f"x={bundle / 'x.npy'}",
                            "--output", tmp_path / "y.npz"])
    assert code == 0, err
    assert np.load(tmp_path / "y.npz")["y"].shape == (1, 10)


def test_dag_json_is_readable_by_others(bundle):
    """Written with the user's umask like the modules beside it (mkstemp alone would give 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    expected = 0o666 & ~mask
    assert (bundle / "dag.json").stat().st_mode & 0o777 == expected
    assert (bundle / "cus" / "manifest.json").stat().st_mode & 0o777 == expected
    assert (bundle / "wasm-bin" / "cu-0000.wasm").stat().st_mode & 0o777 == expected
