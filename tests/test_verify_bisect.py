"""`cortex verify --bisect` names the CU whose own outputs are wrong, and `--dump DIR` writes it as a
reproduction whose command shows the mismatch again.

A wrong CU is planted the way a miscompiled one would look: the model is compiled twice, once as
it is and once with one node or constant changed (same CU interfaces), and one CU's module of the
second build replaces the first's, its dag.json record (sha256, memory plan) with it, so that
loading accepts it. Its cu.onnx stays the original: onnxruntime on it is the truth."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.registry import target
from backends.wasm.options import parse_options
from cli_helpers import CORTEX, TIMEOUT_S, assert_one_line_error, run_cli
from bench.conformance.devices import unavailable_reason
from cortex.compile import compile_cu_dir
from cortex.tools.repro import artifact_files
from ir.fs import write_bytes_atomically
from test_fallback_cus import decompose_and_build, feeds as mixed_feeds, mixed_model
from wasm_cases import compile_pipeline

WIDTH = 16
LAYERS = 4


def chain_model(ops: dict[int, str] | None = None, bias_shift: float = 0.0, identity: bool = False,
                tanh: bool = True) -> onnx.ModelProto:
    """LAYERS times MatMul -> Add(bias) [-> Tanh]; `ops` replaces layer i's Add by another op,
    `bias_shift` moves every bias."""
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(LAYERS):
        w = np.eye(WIDTH, dtype=np.float32) if identity else rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.3
        b = rng.standard_normal(WIDTH).astype(np.float32) + np.float32(bias_shift)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"matmul{i}"),
                  helper.make_node((ops or {}).get(i, "Add"), [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}")]
        prev = f"a{i}"
        if tanh:
            nodes.append(helper.make_node("Tanh", [prev], [f"t{i}"], name=f"tanh{i}"))
            prev = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, WIDTH])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [2, WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def compile_chain(folder: Path, model: onnx.ModelProto) -> Path:
    folder.mkdir(parents=True)
    onnx.save(model, folder / "model.onnx")
    return compile_pipeline(folder / "model.onnx", folder, min_cu_size=64, max_cu_depth=1)


def plant(dag_path: Path, wrong_dag_path: Path, cu_ids: list[str], kind: str = "wasm") -> None:
    """Replace these CUs' compiled files in dag_path's build by the other build's, records included
    (both builds name a CU's files alike)."""
    dag, wrong = json.loads(dag_path.read_text()), json.loads(wrong_dag_path.read_text())
    wrong_cus = {cu["id"]: cu for cu in wrong["cus"]}
    for cu in dag["cus"]:
        assert (cu["inputs"], cu["outputs"]) == (wrong_cus[cu["id"]]["inputs"], wrong_cus[cu["id"]]["outputs"])
        if cu["id"] in cu_ids:
            record = wrong_cus[cu["id"]]["artifacts"][kind]
            assert record != cu["artifacts"][kind], "the planted artifact must differ"
            assert artifact_files(kind, record) == artifact_files(kind, cu["artifacts"][kind])
            for relative in artifact_files(kind, record):
                write_bytes_atomically(dag_path.parent / relative, (wrong_dag_path.parent / relative).read_bytes())
            cu["artifacts"][kind] = record
    write_bytes_atomically(dag_path, json.dumps(dag, indent=2).encode())


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """(good dag.json, a dag.json whose cu-0002 computes Sub where its cu.onnx says Add, the model)."""
    root = tmp_path_factory.mktemp("chain")
    good = compile_chain(root / "good", chain_model())
    bad = compile_chain(root / "bad", chain_model())
    wrong = compile_chain(root / "wrong", chain_model(ops={2: "Sub"}))
    ids = [cu["id"] for cu in json.loads(good.read_text())["cus"]]
    assert ids == ["cu-0000", "cu-0001", "cu-0002", "cu-0003"]
    plant(bad, wrong, ["cu-0002"])
    return good, bad, root / "good" / "model.onnx"


def verify_json(dag: Path, model: Path, *extra) -> tuple[int, dict, str]:
    code, out, err = run_cli(["verify", dag, "--model", model, "--bisect", "--json", *extra])
    return code, (json.loads(out) if out.strip() else {}), err


def test_bisect_names_the_planted_cu_and_only_it(chain):
    _, bad, model = chain
    code, report, err = verify_json(bad, model)
    assert code == 1, err
    assert not report["ok"]
    bisect = report["bisect"]
    assert bisect["verdict"] == "diverges" and bisect["named_cu"] == "cu-0002"
    culprit = bisect["first_divergent_cu"]
    assert culprit["cu"] == "cu-0002" and culprit["device"] == "wasm" and not culprit["ok"]
    assert sorted(culprit["op_types"]) == ["Add", "MatMul", "Tanh"]
    [output] = culprit["outputs"]
    # Sub instead of Add moves Tanh's argument by twice the bias: far outside the tolerance.
    assert output["name"] == "t2" and output["max_abs_error"] > 0.1 and output["max_rel_error"] > 0.1
    # The CU after it computes its wrong input correctly: only the planted CU diverges on its own.
    by_cu = {c["cu"]: c for c in bisect["cus"]}
    assert list(by_cu) == ["cu-0000", "cu-0001", "cu-0002", "cu-0003"]
    assert [c["ok"] for c in by_cu.values()] == [True, True, False, True]
    assert by_cu["cu-0003"]["outputs"][0]["max_abs_error"] < 1e-4
    assert bisect["dump"] is None

    code, out, err = run_cli(["verify", bad, "--model", model, "--bisect"])
    assert code == 1, err
    assert "first CU that diverges on its own inputs: cu-0002" in out and "DIVERGES" in out and "MISMATCH" in out


def test_a_correct_model_has_no_diverging_cu(chain):
    good, _, model = chain
    code, report, err = verify_json(good, model)
    assert code == 0, err
    bisect = report["bisect"]
    assert report["ok"] and bisect["verdict"] == "agrees" and bisect["first_divergent_cu"] is None
    assert len(bisect["cus"]) == 4 and all(c["ok"] and c["compared"] for c in bisect["cus"])
    assert bisect["largest_error_cu"]["outputs"][0]["max_abs_error"] < 1e-4
    code, out, err = run_cli(["verify", good, "--model", model, "--bisect"])
    assert code == 0, err
    assert "no CU diverges on its own inputs" in out


def test_the_dump_reproduces_the_mismatch(chain, tmp_path):
    _, bad, model = chain
    dump = tmp_path / "repro"
    dump.mkdir()
    (dump / "stale.txt").write_text("from an earlier dump")
    code, report, err = verify_json(bad, model, "--dump", dump)
    assert code == 1, err
    assert report["bisect"]["dump"] == str(dump)
    files = sorted(str(p.relative_to(dump)) for p in dump.rglob("*") if p.is_file())
    assert files == ["README.md", "actual.npz", "cu.onnx", "dag.json", "expected.npz", "inputs.npz", "repro.sh",
                     "wasm-bin/cu-0002.wasm"]
    dag = json.loads(bad.read_text())
    cu = next(c for c in dag["cus"] if c["id"] == "cu-0002")
    assert (dump / "cu.onnx").read_bytes() == (bad.parent / cu["path"]).read_bytes()
    assert (dump / "wasm-bin/cu-0002.wasm").read_bytes() == (bad.parent / cu["artifacts"]["wasm"]["path"]).read_bytes()

    inputs, expected, actual = (dict(np.load(dump / f"{n}.npz")) for n in ("inputs", "expected", "actual"))
    assert list(inputs) == ["t1"] and list(expected) == list(actual) == ["t2"]
    session = ort.InferenceSession(str(dump / "cu.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["t2"], inputs)[0], expected["t2"], rtol=1e-6, atol=1e-6)
    error = float(np.max(np.abs(actual["t2"] - expected["t2"])))
    assert error == pytest.approx(report["bisect"]["first_divergent_cu"]["outputs"][0]["max_abs_error"], rel=1e-6)

    # The written command, run as written (cortex found on PATH), shows the same mismatch again.
    script = (dump / "repro.sh").read_text()
    assert os.access(dump / "repro.sh", os.X_OK)
    command_line = script.splitlines()[-1].split("exec ", 1)[1]
    assert f"    {command_line}\n" in (dump / "README.md").read_text()
    env = {**os.environ, "PATH": f"{CORTEX.parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["sh", str(dump / "repro.sh")], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=TIMEOUT_S)
    assert result.returncode == 1, result.stderr
    assert "MISMATCH" in result.stdout
    command = shlex.split(command_line)
    assert command[:2] == ["cortex", "verify"]
    code, out, err = run_cli([*command[1:], "--json"], cwd=dump)
    assert code == 1, err
    [row] = json.loads(out)["outputs"]
    assert row["name"] == "t2" and row["max_abs_error"] == pytest.approx(error, rel=1e-6)


def test_dump_needs_bisect(chain, tmp_path):
    _, bad, model = chain
    code, _, err = run_cli(["verify", bad, "--model", model, "--dump", tmp_path / "d"])
    assert_one_line_error(code, err, "--dump", "needs --bisect")
    assert not (tmp_path / "d").exists()


def test_errors_that_accumulate_name_no_diverging_cu(tmp_path):
    """Every CU's bias is off by 1e-3 and the weights are identities, so each CU's own error is
    1e-3 while the output's is 4e-3: within atol 2e-3 CU by CU, outside it for the model."""
    good = compile_chain(tmp_path / "good", chain_model(identity=True, tanh=False))
    shifted = compile_chain(tmp_path / "shifted", chain_model(identity=True, tanh=False, bias_shift=1e-3))
    ids = [cu["id"] for cu in json.loads(good.read_text())["cus"]]
    assert len(ids) == LAYERS
    plant(good, shifted, ids)
    code, report, err = verify_json(good, tmp_path / "good" / "model.onnx", "--rtol", "0", "--atol", "2e-3")
    assert code == 1, err
    bisect = report["bisect"]
    assert report["outputs"][0]["max_abs_error"] == pytest.approx(4e-3, rel=1e-2)
    assert bisect["verdict"] == "accumulates" and bisect["first_divergent_cu"] is None
    assert all(c["ok"] for c in bisect["cus"])
    assert bisect["named_cu"] == bisect["largest_error_cu"]["cu"] in ids
    assert bisect["largest_error_cu"]["outputs"][0]["max_abs_error"] == pytest.approx(1e-3, rel=1e-2)
    assert "accumulates" in bisect["summary"]


@pytest.mark.parametrize("planted, node, op", [("cu-0002", "add", "Sub"), ("cu-0000", "relu", "Abs")])
def test_bisect_with_a_fallback_cu(tmp_path, planted, node, op):
    """The TfIdfVectorizer CU runs on onnxruntime; a wasm CU before or after it is planted."""
    dags = {}
    for name, change in (("good", None), ("wrong", op)):
        model = mixed_model()
        for n in model.graph.node:
            if n.name == node and change:
                n.op_type = change
        onnx.save(model, tmp_path / f"{name}.onnx")
        dags[name] = decompose_and_build(tmp_path / f"{name}.onnx", tmp_path / name)
        compile_cu_dir(target("wasm"), tmp_path / name / "cus", tmp_path / name / "wasm-bin",
                       parse_options(None, "simd", "2"), dags[name])
    plant(dags["good"], dags["wrong"], [planted])
    np.savez(tmp_path / "in.npz", **mixed_feeds())
    code, report, err = verify_json(dags["good"], tmp_path / "good.onnx", "--input", tmp_path / "in.npz",
                                    "--dump", tmp_path / "dump")
    assert code == 1, err
    bisect = report["bisect"]
    by_cu = {c["cu"]: c for c in bisect["cus"]}
    assert list(by_cu) == ["cu-0000", "cu-0001", "cu-0002"]
    assert by_cu["cu-0001"]["fallback"] and by_cu["cu-0001"]["device"] == "onnxruntime"
    assert by_cu["cu-0001"]["op_types"] == ["TfIdfVectorizer"]
    assert bisect["first_divergent_cu"]["cu"] == planted
    assert [cu for cu, c in by_cu.items() if not c["ok"]] == [planted]
    code, out, err = run_cli(["verify", "dag.json", "--model", "cu.onnx", "--input", "inputs.npz"],
                             cwd=tmp_path / "dump")
    assert code == 1 and "MISMATCH" in out, err


@pytest.mark.skipif(unavailable_reason("cuda-sim") is not None, reason=str(unavailable_reason("cuda-sim")))
def test_bisect_and_dump_on_cuda_sim(tmp_path):
    """The same planted CU found on cuda-sim; the dump carries its CUDA files (source, PTX, cubin,
    weights) and reproduces on that device."""
    dags = {}
    for name, model in (("bad", chain_model()), ("wrong", chain_model(ops={2: "Sub"}))):
        (tmp_path / name).mkdir()
        onnx.save(model, tmp_path / name / "model.onnx")
        for argv in (["decompose", "--model-path", "model.onnx", "--output-dir", "cus", "--min-cu-size", "64",
                      "--max-cu-depth", "1"], ["build-dag", "--cu-dir", "cus", "--output", "dag.json"],
                     ["compile-cuda", "--cu-dir", "cus", "--output", "cuda-bin", "--dag", "dag.json", "--arch", "sm_80"]):
            code, _, err = run_cli(argv, cwd=tmp_path / name)
            assert code == 0, err
        dags[name] = tmp_path / name / "dag.json"
    plant(dags["bad"], dags["wrong"], ["cu-0002"], kind="cuda")
    code, report, err = verify_json(dags["bad"], tmp_path / "bad" / "model.onnx", "--device", "cuda-sim",
                                    "--dump", tmp_path / "dump")
    assert code == 1, err
    assert report["bisect"]["first_divergent_cu"]["cu"] == "cu-0002"
    assert [c["cu"] for c in report["bisect"]["cus"] if not c["ok"]] == ["cu-0002"]
    record = next(c for c in json.loads(dags["bad"].read_text())["cus"] if c["id"] == "cu-0002")["artifacts"]["cuda"]
    files = artifact_files("cuda", record)
    assert any(f.endswith(".cubin") for f in files) and any(f.endswith(".cu") for f in files)
    for relative in files:
        assert (tmp_path / "dump" / relative).read_bytes() == (tmp_path / "bad" / relative).read_bytes()
    code, out, err = run_cli(["verify", "dag.json", "--model", "cu.onnx", "--input", "inputs.npz", "--device",
                              "cuda-sim"], cwd=tmp_path / "dump")
    assert code == 1 and "MISMATCH" in out, err
