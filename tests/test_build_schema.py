"""`build.json` follows its JSON Schema (cortex/schemas/build.schema.json), and `cortex build --check`
calls a record that does not follow it stale in one line naming the field."""

from __future__ import annotations

import json
import shutil

import jsonschema
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from testdata import SAMPLES_DIR

from cortex.build_record import BUILD_SCHEMA, StaleBuild, build_schema, read_record
from ir.fs import file_sha256

OPTIONS = ["--dim", "batch=2", "--min-cu-size", "64"]


def test_build_json_follows_its_schema_and_a_record_that_does_not_is_stale(tmp_path):
    shutil.copy(SAMPLES_DIR / "mlp.onnx", tmp_path / "model.onnx")
    np.savez(tmp_path / "feeds.npz", x=np.zeros((2, 2, 64), np.float32))     # two feeds, stacked
    code, _, err = run_cli(["build", "model.onnx", "--output", "out", *OPTIONS, "--cache-inputs-from",
                            "feeds.npz", "--json"], cwd=tmp_path)
    assert code == 0, err
    path = tmp_path / "out" / "build.json"
    record = json.loads(path.read_text())
    jsonschema.validate(record, build_schema())
    jsonschema.Draft202012Validator.check_schema(build_schema())
    assert record["schema"] == BUILD_SCHEMA and record["targets"] == ["wasm"]
    assert record["option_files"] == {"feeds.npz": file_sha256(tmp_path / "feeds.npz")}
    assert {"cus/manifest.json", "dag.json"} <= set(record["artifacts"])
    for name, digest in record["artifacts"].items():
        assert file_sha256(tmp_path / "out" / name) == digest

    path.write_text(json.dumps({**record, "targets": "wasm"}))
    code, _, err = run_cli(["build", "model.onnx", "--output", "out", *OPTIONS, "--cache-inputs-from", "feeds.npz",
                            "--check"], cwd=tmp_path)
    assert_one_line_error(code, err, "not up to date", "does not follow the cortex.build/1 schema",
                          "at targets: 'wasm' is not of type 'array'", exit_code=1)
    path.write_text(json.dumps({**record, "artifacts": {"dag.json": "not-a-hash"}}))
    with pytest.raises(StaleBuild, match=r"schema at artifacts\.dag\.json: 'not-a-hash' does not match"):
        read_record(tmp_path / "out")
