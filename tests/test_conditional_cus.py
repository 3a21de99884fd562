"""Conditional CUs: an If whose branches hold more than --min-cu-size parameters becomes branch CUs
that run only when their condition has their value; its outputs are dag.json `selects`.

The model: h = x @ W0, then an If on `cond` (a model input, or computed as sum(h) > 0) whose then
branch is a two-MatMul chain and whose else branch is a MatMul and Tanh (or, in the pass-through
variant, a constant), and y = If(...) + h. Each branch holds 4,096 or 8,192 parameters, far above
the default --min-cu-size of 256.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import assert_one_line_error, run_cli
from cortex.dag import read_dag, validate_dag
from cortex.runtime import load
from cortex.tools.onnx_reference import run_dag
from testdata import run_onnxruntime

WIDTH = 64
SCHEMAS = "cortex/schemas"


def weight(name: str, shape: tuple, seed: int) -> onnx.TensorProto:
    return numpy_helper.from_array((np.random.default_rng(seed).standard_normal(shape) / 8).astype(np.float32), name)


def if_model(condition: str, width: int = WIDTH, passthrough: bool = False) -> onnx.ModelProto:
    """`condition`: "input" (a bool model input) or "computed" (sum(h) > 0)."""
    row = [1, width]
    then = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w1"], ["t1"]), helper.make_node("Relu", ["t1"], ["t2"]),
         helper.make_node("MatMul", ["t2", "w2"], ["then_out"])], "then", [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, row)],
        [weight("w1", (width, width), 1), weight("w2", (width, width), 2)])
    if passthrough:
        # onnxruntime refuses a branch returning an outer value directly; a constant it accepts.
        otherwise = helper.make_graph([], "else", [], [helper.make_tensor_value_info("fixed", TensorProto.FLOAT, row)],
                                      [weight("fixed", tuple(row), 4)])
    else:
        otherwise = helper.make_graph(
            [helper.make_node("MatMul", ["h", "w3"], ["e1"]), helper.make_node("Tanh", ["e1"], ["else_out"])],
            "else", [], [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, row)],
            [weight("w3", (width, width), 3)])
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, row)]
    if condition == "computed":
        nodes += [helper.make_node("ReduceSum", ["h"], ["s"], keepdims=0),
                  helper.make_node("Greater", ["s", "zero"], ["cond"])]
    else:
        inputs.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    nodes += [helper.make_node("If", ["cond"], ["picked"], name="pick", then_branch=then, else_branch=otherwise),
              helper.make_node("Add", ["picked", "h"], ["y"])]
    graph = helper.make_graph(nodes, "if_model", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, row)],
                              [weight("w0", (width, width), 0), numpy_helper.from_array(np.array(0, np.float32), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def with_output_z(model: onnx.ModelProto) -> onnx.ModelProto:
    """A second output, z = x @ wz, that needs no branch CU."""
    model.graph.initializer.append(weight("wz", (WIDTH, WIDTH), 9))
    model.graph.node.append(helper.make_node("MatMul", ["x", "wz"], ["z"]))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, WIDTH]))
    return model


def build(folder, model: onnx.ModelProto, *extra: str, compile_wasm: bool = True):
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "m.onnx")
    steps = [["decompose", "--model-path", folder / "m.onnx", "--output-dir", folder / "cus", *extra],
             ["build-dag", "--cu-dir", folder / "cus", "--output", folder / "dag.json"]]
    if compile_wasm:
        steps.append(["compile-wasm", "--cu-dir", folder / "cus", "--dag", folder / "dag.json", "--output",
                      folder / "wasm"])
    for argv in steps:
        code, _, err = run_cli(argv)
        assert code == 0, (argv[0], err)
    return json.loads((folder / "dag.json").read_text())


def feeds_for(condition: str, x_sign: float, cond: bool) -> dict:
    x = (x_sign * np.abs(np.random.default_rng(5).standard_normal((1, WIDTH)))).astype(np.float32)
    return {"x": x} if condition == "computed" else {"x": x, "cond": np.array(cond)}


def branch_cus(dag: dict) -> dict[bool, set[str]]:
    found = {True: set(), False: set()}
    for cu in dag["cus"]:
        if "activation" in cu:
            assert cu["activation"]["tensor"] == "cond"
            found[cu["activation"]["equals"]].add(cu["id"])
    return found


@pytest.mark.parametrize("condition", ["input", "computed"])
def test_only_the_taken_branch_runs(tmp_path, condition):
    dag = build(tmp_path, if_model(condition))
    validate_dag(dag)
    read_dag(tmp_path / "dag.json")      # the invariants beyond the schema
    manifest = json.loads((tmp_path / "cus" / "manifest.json").read_text())
    jsonschema.validate(manifest, json.loads(open(f"{SCHEMAS}/manifest.schema.json").read()))
    branches = branch_cus(dag)
    assert branches[True] and branches[False] and not branches[True] & branches[False]
    assert dag["selects"] == manifest["selects"]
    (select,) = dag["selects"]
    assert select["tensor"] == "picked" and select["condition"] == "cond"
    assert {c["equals"] for c in select["cases"]} == {True, False}
    assert dag["tensors"]["picked"]["producer"] is None
    # The CU after the If reads the select, after every case's CU in the order.
    (after,) = [cu["id"] for cu in dag["cus"] if "picked" in cu["inputs"]]
    assert all(dag["order"].index(c) < dag["order"].index(after) for c in branches[True] | branches[False])
    if condition == "computed":
        (decider,) = [cu for cu in dag["cus"] if "cond" in cu["outputs"]]
        assert "activation" not in decider

    model = load(tmp_path / "dag.json", cache_bytes=0)     # every skip below is a branch's, none a cache hit
    # h is linear in x, so flipping x's sign flips the computed condition: both branches are taken.
    cases = [(1.0, None), (-1.0, None)] if condition == "computed" else [(1.0, True), (1.0, False)]
    for x_sign, taken in cases:
        feeds = feeds_for(condition, x_sign, taken)
        if taken is None:
            w0 = numpy_helper.to_array(weight("w0", (WIDTH, WIDTH), 0))
            taken = bool((feeds["x"] @ w0).sum() > 0)
        expected = run_onnxruntime(tmp_path / "m.onnx", feeds)["y"]
        got = model.run(feeds)["y"]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        trace = model.trace_document()
        assert {s["cu"] for s in trace["skipped_cus"]} == branches[not taken]
        assert {s["reason"] for s in trace["skipped_cus"]} == {"inactive branch"}
        assert branches[taken] <= set(trace["activated_cus"])
        assert not branches[not taken] & {t["cu"] for t in trace["cus"]}
        # Each cu.onnx on onnxruntime, CU by CU, as the reference checks run them.
        np.testing.assert_allclose(run_dag(tmp_path / "dag.json", feeds)["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cond", [True, False])
def test_verify_passes_on_branch_cus(tmp_path, cond):
    build(tmp_path, if_model("input"))
    np.save(tmp_path / "cond.npy", np.array(cond))
    code, out, err = run_cli(["verify", tmp_path / "dag.json", "--model", tmp_path / "m.onnx", "--input",
                              f"cond={tmp_path / 'cond.npy'}", "--json"])
    assert code == 0, err
    assert json.loads(out)["ok"]


def test_a_branch_returning_a_constant_gets_a_case_tensor_of_its_own(tmp_path):
    dag = build(tmp_path, if_model("input", passthrough=True))
    (select,) = dag["selects"]
    case = {c["equals"]: c["tensor"] for c in select["cases"]}
    (copier,) = [cu for cu in dag["cus"] if case[False] in cu["outputs"]]
    assert copier["activation"] == {"tensor": "cond", "equals": False}
    assert copier["op_types"] == ["Identity"] and copier["inputs"] == []    # it copies the constant
    model = load(tmp_path / "dag.json")
    for taken in (True, False):
        feeds = feeds_for("input", 1.0, taken)
        np.testing.assert_allclose(model.run(feeds)["y"], run_onnxruntime(tmp_path / "m.onnx", feeds)["y"],
                                   rtol=1e-5, atol=1e-5)


def test_a_small_if_stays_in_one_cu(tmp_path):
    # 8x8 weights: 64 and 128 parameters per branch, under the default --min-cu-size of 256.
    dag = build(tmp_path, if_model("input", width=8), compile_wasm=False)
    assert "selects" not in dag and not any("activation" in cu for cu in dag["cus"])
    (holder,) = [cu for cu in dag["cus"] if "If" in cu["op_types"]]
    assert "cond" in holder["inputs"]
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    for taken in (True, False):
        feeds = {"x": x, "cond": np.array(taken)}
        np.testing.assert_allclose(run_dag(tmp_path / "dag.json", feeds)["y"],
                                   run_onnxruntime(tmp_path / "m.onnx", feeds)["y"], rtol=1e-5, atol=1e-5)


def test_dag_checks_refuse_broken_selects(tmp_path):
    dag = build(tmp_path, if_model("input"), compile_wasm=False)
    branches = branch_cus(dag)
    then_cu = next(cu for cu in dag["cus"] if cu["id"] in branches[True])
    case = next(c["tensor"] for c in dag["selects"][0]["cases"] if c["equals"])
    reader = next(cu for cu in dag["cus"] if "picked" in cu["inputs"])

    def refused(edit, *fragments):
        broken = json.loads(json.dumps(dag))
        edit(broken)
        (tmp_path / "broken.json").write_text(json.dumps(broken))
        code, _, err = run_cli(["run", tmp_path / "broken.json", "--device", "onnxruntime"])
        assert_one_line_error(code, err, *fragments)

    def wrong_value(d):
        next(cu for cu in d["cus"] if cu["id"] == then_cu["id"])["activation"]["equals"] = False
    refused(wrong_value, f"case {case!r} is not produced by a CU activated when 'cond' is True")

    def reads_the_case(d):
        cu = next(cu for cu in d["cus"] if cu["id"] == reader["id"])
        cu["inputs"] = [case if n == "picked" else n for n in cu["inputs"]]
    refused(reads_the_case, f"{reader['id']} reads {case!r}", "must read the select")

    def float_condition(d):
        d["tensors"]["cond"]["dtype"] = "float32"
        d["tensors"]["cond"]["bytes"] = 4
        for spec in d["inputs"]:
            if spec["name"] == "cond":
                spec["dtype"] = "float32"
    refused(float_condition, "activation tensor 'cond'", "one-element bool")

    def reader_first(d):
        d["order"].remove(reader["id"])
        d["order"].insert(1, reader["id"])
    refused(reader_first, "'order' is not topological", "select 'picked'")


def test_a_branch_over_max_cu_size_is_split_inside_its_branch(tmp_path):
    # 4,096-parameter MatMuls under --max-cu-size 2000: each splits in pieces joined by a Concat,
    # and every piece keeps the activation of the branch it came from.
    dag = build(tmp_path, if_model("computed"), "--max-cu-size", "2000", compile_wasm=False)
    assert all(cu["params"] <= 2000 for cu in dag["cus"])
    branches = branch_cus(dag)
    assert len(branches[True]) >= 4 and len(branches[False]) >= 2
    joins = [cu for cu in dag["cus"] if "Concat" in cu["op_types"]]
    assert sum(1 for cu in joins if "activation" in cu) == 3     # w1, w2 (then) and w3 (else)
    w0 = numpy_helper.to_array(weight("w0", (WIDTH, WIDTH), 0))
    seen = set()
    for sign in (1.0, -1.0):
        feeds = feeds_for("computed", sign, None)
        seen.add(bool((feeds["x"] @ w0).sum() > 0))
        np.testing.assert_allclose(run_dag(tmp_path / "dag.json", feeds)["y"],
                                   run_onnxruntime(tmp_path / "m.onnx", feeds)["y"], rtol=1e-5, atol=1e-5)
    assert seen == {True, False}


def test_requested_outputs_skip_the_branch_cus_they_do_not_need(tmp_path):
    dag = build(tmp_path, with_output_z(if_model("computed")))
    branches = branch_cus(dag)
    model = load(tmp_path / "dag.json", cache_bytes=0, threads=1)
    for sign in (1.0, -1.0):
        feeds = feeds_for("computed", sign, None)
        expected = run_onnxruntime(tmp_path / "m.onnx", feeds)
        got = model.run(feeds, outputs=["z"])
        np.testing.assert_allclose(got["z"], expected["z"], rtol=1e-5, atol=1e-5)
        skipped = {s["cu"]: s["reason"] for s in model.trace_document()["skipped_cus"]}
        # Not needed comes first: neither branch is read for its condition, nor resolves the select.
        assert {skipped[cu] for cu in branches[True] | branches[False]} == {"not needed"}
        np.testing.assert_allclose(model.run(feeds, outputs=["y"])["y"], expected["y"], rtol=1e-5, atol=1e-5)
