"""`cortex bundle`: the folder a static server hosts (dag.json, the modules, the JS runtime, the page),
written atomically; bad inputs are one line and leave --output as it was."""

from __future__ import annotations

import json

from cli_helpers import assert_one_line_error, run_cli
from js_cases import compiled_case
from testdata import sample_model

from cortex.dag import read_dag


def _compiled_dag():
    listing = compiled_case(sample_model("mlp"), "simd", min_cu_size=256, max_cu_depth=3)
    return listing.parent / json.loads(listing.read_text())["dag"]


def test_the_bundle_holds_the_model_the_runtime_and_the_page(tmp_path):
    dag = _compiled_dag()
    site = tmp_path / "site"
    code, out, err = run_cli(["bundle", dag, "--output", site, "--json"])
    assert code == 0, err
    summary = json.loads(out)
    bundled = read_dag(site / "dag.json")          # schema, data flow, every artifact present
    assert "source_model" not in bundled
    assert summary["cus"] == len(bundled["cus"])
    for cu in bundled["cus"]:
        assert (site / cu["artifacts"]["wasm"]["path"]).is_file()
    assert {p.name for p in (site / "cortex-runtime").iterdir()} >= {"index.js", "session.js", "scheduler.js"}
    assert (site / "index.html").is_file() and (site / "main.js").is_file()
    assert (site / "index.html").stat().st_mode & 0o044, "a web server must be able to read the page"


def test_a_tampered_module_is_refused_and_output_is_left_as_it_was(tmp_path):
    dag = _compiled_dag()
    copy = tmp_path / "model"
    copy.mkdir()
    document = json.loads(dag.read_text())
    (copy / "dag.json").write_text(json.dumps(document))
    for cu in document["cus"]:
        target = copy / cu["artifacts"]["wasm"]["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((dag.parent / cu["artifacts"]["wasm"]["path"]).read_bytes())
    broken = copy / document["cus"][0]["artifacts"]["wasm"]["path"]
    broken.write_bytes(broken.read_bytes() + b"\0")
    site = tmp_path / "site"
    site.mkdir()
    (site / "keep.txt").write_text("before")
    code, _, err = run_cli(["bundle", copy / "dag.json", "--output", site])
    assert_one_line_error(code, err, broken.name, "sha256 differs")
    assert [p.name for p in site.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".site")], "a temporary folder was left behind"


def test_bad_arguments_are_one_line(tmp_path):
    code, _, err = run_cli(["bundle", tmp_path / "missing.json", "--output", tmp_path / "site"])
    assert_one_line_error(code, err, "missing.json")
    dag = _compiled_dag()
    code, _, err = run_cli(["bundle", dag, "--output", dag.parent])
    assert_one_line_error(code, err, "--output", "bundle into another folder")
    code, _, err = run_cli(["bundle", dag, "--output", tmp_path / "site", "--onnxruntime-web", tmp_path])
    assert_one_line_error(code, err, "--onnxruntime-web", "nothing in the bundle needs it")
    assert not (tmp_path / "site").exists()
