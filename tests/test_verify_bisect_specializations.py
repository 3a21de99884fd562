"""`cortex verify --bisect` on a dag.json of shape specializations: it bisects the specialization
the inputs select (or `--specialization` names). One CU of one specialization is planted wrong
(its module from a build where that layer's Add is a Sub); the other specialization is intact."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli
from specialized_builds import WIDTH, build_in_process, chain_model, plant

import cortex
from ir.errors import CortexError


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """(dag.json for batch 2 and 4 whose batch=4 cu-0002 computes Sub where its cu.onnx says Add,
    the model, a folder holding x2.npy and x4.npy)."""
    root = tmp_path_factory.mktemp("bisect-specialized")
    model = chain_model(root / "chain.onnx")
    bad = build_in_process(model, root / "bad", "--dim", "batch=2,4")
    wrong = build_in_process(chain_model(root / "wrong.onnx", sub_at=2), root / "wrong", "--dim", "batch=2,4")
    assert [cu["id"] for cu in json.loads(bad.read_text())["specializations"][1]["cus"]] == \
        ["cu-0000", "cu-0001", "cu-0002", "cu-0003"]
    plant(bad, wrong, "batch=4", "cu-0002")
    for batch in (2, 3, 4):
        np.save(root / f"x{batch}.npy", np.random.default_rng(batch).standard_normal((batch, WIDTH)).astype(np.float32))
    return bad, model, root


def verify_json(dag, model, *extra) -> tuple[int, dict, str]:
    code, out, err = run_cli(["verify", dag, "--model", model, "--bisect", "--json", *extra])
    return code, (json.loads(out) if out.strip() else {}), err


def test_bisect_names_the_planted_cu_of_the_specialization_the_inputs_select(broken):
    bad, model, root = broken
    code, report, err = verify_json(bad, model, "--input", f"x={root / 'x4.npy'}")
    assert code == 1, err
    assert report["specialization"] == "batch=4" and not report["ok"]
    assert report["outputs"][0]["shape"] == [4, WIDTH]
    bisect = report["bisect"]
    assert bisect["verdict"] == "diverges" and bisect["named_cu"] == "cu-0002"
    assert [c["ok"] for c in bisect["cus"]] == [True, True, False, True]
    assert bisect["first_divergent_cu"]["outputs"][0]["max_abs_error"] > 0.1


def test_the_intact_specialization_bisects_clean(broken):
    bad, model, root = broken
    code, report, err = verify_json(bad, model, "--input", f"x={root / 'x2.npy'}")
    assert code == 0, err
    assert report["specialization"] == "batch=2" and report["ok"]
    assert report["bisect"]["verdict"] == "agrees" and all(c["ok"] for c in report["bisect"]["cus"])


@pytest.mark.slow
def test_specialization_option_with_example_inputs_and_a_dump_that_reproduces(broken, tmp_path):
    bad, model, _ = broken
    dump = tmp_path / "repro"
    code, report, err = verify_json(bad, model, "--specialization", "batch=4", "--dump", dump)
    assert code == 1, err
    assert report["specialization"] == "batch=4" and report["bisect"]["named_cu"] == "cu-0002"
    # The reproduction carries the module and its weight files (outside the module in a specialized build).
    record = json.loads((dump / "dag.json").read_text())["cus"][0]["artifacts"]["wasm"]
    assert record["weights"] and all((dump / w["path"]).is_file() for w in record["weights"])
    code, out, err = run_cli(["verify", "dag.json", "--model", "cu.onnx", "--input", "inputs.npz", "--json"], cwd=dump)
    assert code == 1, err
    assert not json.loads(out)["ok"]


def test_a_wrong_specialization_choice_is_one_line(broken):
    bad, model, _ = broken
    code, _, err = verify_json(bad, model, "--specialization", "batch=3")
    assert_one_line_error(code, err, "--specialization batch=3", "no such specialization", "batch=2, batch=4")
    loaded = cortex.load(bad)
    with pytest.raises(CortexError, match=r"--specialization batch=2 takes x=2x16, the inputs have x=4x16"):
        loaded.select({"x": [4, WIDTH]}, "batch=2")
    with pytest.raises(CortexError, match=r"no shape specialization matches the inputs \(x=3x16\).*batch=2.*batch=4"):
        loaded.select({"x": [3, WIDTH]})
    assert loaded.select({}) == 0 and loaded.select({"x": [4, WIDTH], "frozen": [1]}) == 1
    assert loaded.loaded_specializations() == []          # choosing loads nothing
