"""Value specializations: a model whose If is decided by an input (a voice-activity model's `sr`),
its branches of different shapes, built once for several values of that input (`decompose
--specialize sr=8000,16000`) and run for each value from the one build, in Python (cortex.load and
`cortex run`), with the value checked and the weights both values share stored once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_helpers import assert_one_line_error, run_cli
from js_cases import NODE, run_node_tests, write_case, write_requests
from serve_cases import Server, output_array, tensor
from onnx import TensorProto, helper, numpy_helper
from specialized_builds import VAD_FRAMES, build_in_process, vad_model

import cortex
from cortex.specializations import validate_specialized_dag
from ir.errors import CortexError

RTOL, ATOL = 1e-4, 1e-5
RATES = (8000, 16000)


@pytest.fixture(scope="module")
def vad_build(tmp_path_factory) -> Path:
    """The exported model built once for both rates: its dag.json."""
    return build_in_process(vad_model(), tmp_path_factory.mktemp("vad"), "--specialize", "sr=8000,16000")


def window(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 1, 512)).astype(np.float32)


def reference(feeds: dict) -> np.ndarray:
    return ort.InferenceSession(str(vad_model()), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_the_export_is_an_if_decided_by_sr_with_branches_of_different_shapes():
    graph = onnx.load(vad_model()).graph
    assert [i.name for i in graph.input] == ["x", "sr"]
    assert "If" in [n.op_type for n in graph.node]
    assert {sr: reference({"x": window(), "sr": np.array(sr)}).shape for sr in RATES} == \
        {sr: (1, frames, 4) for sr, frames in VAD_FRAMES.items()}


def test_one_build_runs_both_rates_as_onnxruntime_does(vad_build):
    model = cortex.load(vad_build)
    assert [(i["name"], i["dtype"], i["shape"]) for i in model.inputs] == [("x", "float32", [1, 1, 512]),
                                                                           ("sr", "int64", [])]
    for seed, sr in enumerate([16000, 8000, 16000]):
        feeds = {"x": window(seed), "sr": np.array(sr)}
        got = model.run(feeds)["speech"]
        assert model.specialization == f"sr={sr}"
        assert got.shape == (1, VAD_FRAMES[sr], 4)
        np.testing.assert_allclose(got, reference(feeds), rtol=RTOL, atol=ATOL)


def test_the_bundle_records_each_value_and_follows_its_schema(vad_build):
    dag = json.loads(vad_build.read_text())
    validate_specialized_dag(dag)
    assert dag["schema"] == "cortex.dag/2"
    sections = {s["name"]: s for s in dag["specializations"]}
    assert list(sections) == ["sr=8000", "sr=16000"]
    for sr in RATES:
        section = sections[f"sr={sr}"]
        assert section["input_values"] == {"sr": sr}
        assert section["input_shapes"] == {"x": [1, 1, 512], "sr": []}
        assert [i["name"] for i in section["inputs"]] == ["x"]       # the build froze sr
        assert [o["shape"] for o in section["outputs"]] == [[1, VAD_FRAMES[sr], 4]]


def test_a_value_not_compiled_or_a_wrong_sr_is_one_error(vad_build):
    model = cortex.load(vad_build)
    x = window()
    cases = [({"x": x, "sr": np.array(44100)}, "no value specialization matches the inputs (sr=44100); "
              f"{vad_build} was compiled for: sr=8000; sr=16000"),
             ({"x": x, "sr": np.array(8000, np.int32)}, "input 'sr' has dtype int32, the model expects int64"),
             ({"x": x, "sr": np.array([8000])}, "input 'sr' has shape [1], the model expects []"),
             ({"x": x}, "missing input 'sr' (int64[])")]
    for feeds, message in cases:
        with pytest.raises(CortexError) as raised:
            model.run(feeds)
        assert str(raised.value) == message


def test_cortex_run_runs_both_rates_and_names_the_compiled_ones(vad_build, tmp_path):
    for sr in RATES:
        feeds = {"x": window(sr), "sr": np.array(sr)}
        np.savez(tmp_path / f"in-{sr}.npz", **feeds)
        code, _, err = run_cli(["run", vad_build, "--input", tmp_path / f"in-{sr}.npz", "--output", tmp_path / f"{sr}.npz"])
        assert code == 0, err
        with np.load(tmp_path / f"{sr}.npz") as got:
            np.testing.assert_allclose(got["speech"], reference(feeds), rtol=RTOL, atol=ATOL)
    np.savez(tmp_path / "in-44100.npz", x=window(), sr=np.array(44100))
    code, _, err = run_cli(["run", vad_build, "--input", tmp_path / "in-44100.npz", "--output", tmp_path / "no.npz"])
    assert_one_line_error(code, err, "no value specialization matches the inputs (sr=44100)",
                          "was compiled for: sr=8000; sr=16000")
    assert not (tmp_path / "no.npz").exists()


def test_the_rates_share_the_weights_both_use_stored_once(vad_build):
    """The projection after the If is the same weight in both sections: one file, named by its
    sha256, that both sections' modules read; each rate's filter is a file of its own, in the wasm
    build and in the CU folders (ONNX external data, the initializer's bytes)."""
    out = vad_build.parent
    dag = json.loads(vad_build.read_text())
    used = [{w["path"] for cu in s["cus"] for w in cu["artifacts"]["wasm"]["weights"]} for s in dag["specializations"]]
    shared = used[0] & used[1]
    assert len(shared) == 1 and len(used[0]) == len(used[1]) == 2
    stored = {f"wasm-bin/weights/{p.name}" for p in (out / "wasm-bin" / "weights").glob("*.bin")}
    assert stored == used[0] | used[1]
    initializers = {t.name: numpy_helper.to_array(t) for t in onnx.load(vad_model()).graph.initializer}
    filters = {p.read_bytes() for p in (out / "cus" / "models" / "weights").glob("*.bin")}
    assert filters == {np.ascontiguousarray(initializers[name]).tobytes() for name in ("taps8k", "taps16k")}


def refused_requests(model, dag_path: Path) -> list[tuple[dict, str]]:
    """Requests every runtime refuses, each with the Python runtime's message (DAG: the model)."""
    x = window()
    found = []
    for feeds in ({"x": x, "sr": np.array(44100)}, {"x": x, "sr": np.array(16000, np.int32)},
                  {"x": x, "sr": np.array([16000])}, {"x": x}):
        with pytest.raises(CortexError) as raised:
            model.run(feeds)
        found.append((feeds, str(raised.value).replace(str(dag_path), "DAG")))
    return found


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_node_runs_both_rates_from_one_build_and_refuses_others_as_python_does(vad_build, tmp_path):
    model = cortex.load(vad_build)
    rates = [16000, 8000, 16000]
    requests = [{"inputs": {"x": window(i), "sr": np.array(sr)}} for i, sr in enumerate(rates)]
    for request in requests:
        request["outputs"] = {"speech": reference(request["inputs"])}
    case = write_case(tmp_path, "value-specialized-vad", vad_build, requests, RTOL, ATOL)
    refused = refused_requests(model, vad_build)
    (tmp_path / "refused").mkdir()
    described = write_requests(tmp_path / "refused", [{"inputs": feeds, "outputs": {}} for feeds, _ in refused])
    document = json.loads(case.read_text())
    document["value_specialized"] = {
        "inputs": [["x", "float32", [1, 1, 512]], ["sr", "int64", []]],
        "specializations": [f"sr={sr}" for sr in rates],
        "refused": [{"inputs": {n: {**t, "file": f"refused/{t['file']}"} for n, t in d["inputs"].items()},
                     "message": message} for d, (_, message) in zip(described, refused)]}
    case.write_text(json.dumps(document, indent=1))
    (tmp_path / "node").mkdir()
    report = run_node_tests([case], tmp_path / "node", "specialized.test.js")
    passed = set(re.findall(r"^ok \d+ - (.+)$", report, re.MULTILINE))
    assert {"value-specialized-vad: each compiled value runs on its specialization",
            "value-specialized-vad: a value not compiled is refused in one line naming the compiled ones"} <= passed, \
        report[-3000:]


def test_cortex_serve_serves_both_rates_and_answers_another_with_one_400_line(vad_build):
    server = Server(vad_build, "--workers", "1")
    try:
        status, _, body = server.request("GET", f"/v2/models/{server.model}")
        assert status == 200
        inputs = {i["name"]: (i["datatype"], i["shape"]) for i in json.loads(body)["inputs"]}
        assert inputs == {"x": ("FP32", [1, 1, 512]), "sr": ("INT64", [])}
        assert json.loads(body)["parameters"]["cortex_specializations"] == "sr=8000;sr=16000"
        for seed, sr in enumerate([8000, 16000, 44100, 8000]):
            x = window(seed)
            status, document = server.infer({"inputs": [tensor("x", x), tensor("sr", np.array(sr), "INT64")]})
            if sr == 44100:
                assert status == 400, document
                assert document["error"] == ("no value specialization matches the inputs (sr=44100); model "
                                             f"'{server.model}' was compiled for: sr=8000; sr=16000")
                continue
            assert status == 200, document
            np.testing.assert_allclose(output_array(document, "speech"), reference({"x": x, "sr": np.array(sr)}),
                                       rtol=RTOL, atol=ATOL)
        status, document = server.infer({"inputs": [tensor("x", window()), tensor("sr", np.array(8000), "INT32")]})
        assert status == 400 and document["error"] == "input 'sr' has datatype 'INT32', the model expects INT64"
    finally:
        server.stop()


@pytest.mark.slow
def test_the_ray_executor_runs_both_rates_through_the_same_picker(vad_build, monkeypatch):
    """cortex.load(..., executor="ray") makes one SpecializedModel whose sections run on Ray
    actors: the value picks the section before Ray sees the request."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")     # read when Ray is first imported
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster   # imports Ray's cluster helpers only when this slow test runs

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        # Each section a request picks places its own actors: half a CPU each, both fit one node.
        model = cortex.load(vad_build, executor="ray", address=cluster.address, executor_options={"num_cpus": 0.5, "replicas": 1})
        try:
            for seed, sr in enumerate(RATES):
                feeds = {"x": window(seed), "sr": np.array(sr)}
                np.testing.assert_allclose(model.run(feeds)["speech"], reference(feeds), rtol=RTOL, atol=ATOL)
                assert model.specialization == f"sr={sr}"
            with pytest.raises(CortexError, match=r"no value specialization matches the inputs \(sr=44100\)"):
                model.run({"x": window(), "sr": np.array(44100)})
        finally:
            model.close()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


# -- finding the values -------------------------------------------------------------------------

def rate_chain_model(path: Path) -> Path:
    """if sr == 16000: 2 frames, elif sr == 8000: 4 frames, else: 1 frame (the If nested in the
    else branch, as an elif exports), each a Reshape of x[8] with its own constant."""
    def branch(name: str, frames: int) -> onnx.GraphProto:
        shape = numpy_helper.from_array(np.array([frames, 8 // frames], np.int64), f"{name}_shape")
        return helper.make_graph([helper.make_node("Reshape", ["x", f"{name}_shape"], [f"{name}_y"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, None)], [shape])

    inner = helper.make_graph(
        [helper.make_node("Equal", ["sr", "rate8k"], ["is8k"]),
         helper.make_node("If", ["is8k"], ["inner_y"], then_branch=branch("at8k", 4), else_branch=branch("other", 1))],
        "elif", [], [helper.make_tensor_value_info("inner_y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(8000, np.int64), "rate8k")])
    graph = helper.make_graph(
        [helper.make_node("Equal", ["sr", "rate16k"], ["is16k"]),
         helper.make_node("If", ["is16k"], ["y"], then_branch=branch("at16k", 2), else_branch=inner)],
        "rates", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8]),
                  helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(16000, np.int64), "rate16k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_specialize_without_values_takes_the_values_the_if_compares_sr_with(tmp_path):
    model_path = rate_chain_model(tmp_path / "rates.onnx")
    dag_path = build_in_process(model_path, tmp_path / "out", "--specialize", "sr")
    dag = json.loads(dag_path.read_text())
    assert [s["name"] for s in dag["specializations"]] == ["sr=16000", "sr=8000"]
    model = cortex.load(dag_path)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    x = np.arange(8, dtype=np.float32)
    for sr in (8000, 16000):
        got = model.run({"x": x, "sr": np.array(sr)})["y"]
        np.testing.assert_array_equal(got, session.run(None, {"x": x, "sr": np.array(sr)})[0])


def test_specialize_without_values_on_a_single_comparison_asks_for_the_values(tmp_path):
    code, _, err = run_cli(["decompose", "--model-path", vad_model(), "--output-dir", tmp_path / "out",
                            "--specialize", "sr"])
    assert_one_line_error(code, err, "--specialize sr: the model's If compares sr with 16000 only",
                          "--specialize sr=16000,OTHER")
    assert not (tmp_path / "out").exists()


def doubling_model(path: Path) -> Path:
    """x[batch, 4]: if sr == 16000, Concat(x, x) along axis 1 ([batch, 8]), else Tanh(x) ([batch, 4])."""
    def branch(name: str, node) -> onnx.GraphProto:
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)])

    graph = helper.make_graph(
        [helper.make_node("Equal", ["sr", "rate16k"], ["is16k"]),
         helper.make_node("If", ["is16k"], ["y"],
                          then_branch=branch("wide", helper.make_node("Concat", ["x", "x"], ["wide_y"], axis=1)),
                          else_branch=branch("same", helper.make_node("Tanh", ["x"], ["same_y"])))],
        "doubling", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                     helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(16000, np.int64), "rate16k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_values_combine_with_shape_specializations(tmp_path):
    model_path = doubling_model(tmp_path / "doubling.onnx")
    dag_path = build_in_process(model_path, tmp_path / "out", "--dim", "batch=1,2", "--specialize", "sr=8000,16000")
    names = [s["name"] for s in json.loads(dag_path.read_text())["specializations"]]
    assert names == ["batch=1,sr=8000", "batch=1,sr=16000", "batch=2,sr=8000", "batch=2,sr=16000"]
    model = cortex.load(dag_path)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    for batch in (2, 1):
        for sr in RATES:
            feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32), "sr": np.array(sr)}
            np.testing.assert_allclose(model.run(feeds)["y"], session.run(None, feeds)[0], rtol=RTOL, atol=ATOL)
            assert model.specialization == f"batch={batch},sr={sr}"
    with pytest.raises(CortexError, match=r"^no shape specialization matches the inputs \(x=3x4 sr=scalar\)"):
        model.run({"x": np.zeros((3, 4), np.float32), "sr": np.array(8000)})


def test_the_offline_policy_is_refused_in_one_line(vad_build):
    with pytest.raises(CortexError, match="the CUs were built with --freeze-input sr; the source model still "
                                          "takes those inputs"):
        cortex.load(vad_build, policy="offline").run({"x": window(), "sr": np.array(8000)})


# -- refusals -----------------------------------------------------------------------------------

def test_without_the_flag_the_error_names_sr_and_both_ways_to_specialise_it(tmp_path):
    code, _, err = run_cli(["decompose", "--model-path", vad_model(), "--output-dir", tmp_path / "out"])
    assert_one_line_error(code, err, "model input 'sr'", "--freeze-input sr=VALUE.npy",
                          "or for several in one bundle with --specialize sr=V1,V2")


@pytest.mark.parametrize("flag, fragments", [
    ("rate=8000,16000", ["--specialize names 'rate', which is not an input of the model (inputs: x, sr)"]),
    ("x=1,2", ["--specialize x: the input has shape [1, 1, 512]; a value specialization takes an input of one element"]),
    ("sr=8000,,16000", ["bad --specialize 'sr=8000,,16000': expected NAME=V1,V2,..."]),
    ("sr=", ["bad --specialize 'sr=': expected NAME=V1,V2,..."]),
    ("sr=8000.5", ["--specialize sr=8000.5: the input is int64, which cannot hold '8000.5'"]),
    ("sr=16k", ["--specialize sr=16k: the input is int64, which cannot hold '16k'"]),
    ("sr=99999999999999999999", ["the input is int64, which cannot hold '99999999999999999999'"]),
    ("sr=8000,08000", ["--specialize sr: each value once"]),
], ids=["not-an-input", "not-one-element", "empty-value", "no-values", "fraction", "text", "too-large", "twice"])
def test_a_bad_specialize_is_one_line_and_writes_nothing(tmp_path, flag, fragments):
    code, _, err = run_cli(["decompose", "--model-path", vad_model(), "--output-dir", tmp_path / "out",
                            "--specialize", flag])
    assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "out").exists()
