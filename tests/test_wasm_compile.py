"""`cortex compile-wasm`: options, what the modules contain, determinism, dag.json records, and
one-line errors that leave the output folder as it was."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from backends.wasm.options import parse_options
from cli_helpers import assert_one_line_error, run_cli
from ir.fs import file_sha256
from cortex.dag import validate_dag
from ir.errors import CortexError
from testdata import sample_model
from wasm_cases import compile_pipeline, make_model




@pytest.fixture(scope="module")
def cnn_dirs(tmp_path_factory):
    """The cnn sample decomposed and its dag built (compiled once with defaults)."""
    case = sample_model("cnn")
    out = tmp_path_factory.mktemp("cnn")
    compile_pipeline(case.path, out, min_cu_size=64, max_cu_depth=3)
    return out


def compile_cli(out, *extra, output="bin"):
    return run_cli(["compile-wasm", "--cu-dir", str(out / "cus"), "--output", str(out / output), "--json", *extra])


def test_dag_records_each_artifact_and_still_validates(cnn_dirs):
    code, _, err = compile_cli(cnn_dirs, "--dag", str(cnn_dirs / "dag.json"), "--features", "simd",
                               "--opt-level", "1", output="wasm-bin")
    assert code == 0, err
    dag = json.loads((cnn_dirs / "dag.json").read_text())
    validate_dag(dag)
    for cu in dag["cus"]:
        record = cu["artifacts"]["wasm"]
        path = cnn_dirs / record["path"]
        assert file_sha256(path) == record["sha256"] and path.stat().st_size == record["bytes"]
        assert record["options"] == {"target": "wasm32-unknown-unknown", "features": ["simd"], "opt_level": "1"}
        assert [e["name"] for e in record["memory"]["inputs"]] == cu["inputs"]
        assert [e["name"] for e in record["memory"]["outputs"]] == cu["outputs"]


def test_builds_are_byte_identical(cnn_dirs):
    for name in ("a", "b"):
        code, _, err = compile_cli(cnn_dirs, "--opt-level", "3", "--features", "simd,relaxed-simd", output=name)
        assert code == 0, err
    a, b = sorted((cnn_dirs / "a").glob("*.wasm")), sorted((cnn_dirs / "b").glob("*.wasm"))
    assert a and [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


@pytest.mark.parametrize("features,level,present,absent", [
    ("", "0", [], ["v128", "memory.init"]),
    ("simd", "0", [], ["v128"]),
    ("simd", "3", ["v128.load", "f32x4.add"], ["relaxed_madd", "memory.init"]),
    ("simd,relaxed-simd", "3", ["f32x4.relaxed_madd"], []),
    ("simd,bulk-memory", "2", ["v128", "memory.init", "data.drop"], []),   # passive weight segments
    ("simd", "2", ["v128"], ["memory.init", "data.drop"]),                 # active, mapped copy-on-write
    ("simd", "z", [], ["v128"]),
])
def test_features_and_opt_levels_shape_the_code(cnn_dirs, features, level, present, absent):
    code, _, err = compile_cli(cnn_dirs, "--features", features, "--opt-level", level, "--emit-wat", output="w")
    assert code == 0, err
    wat = "\n".join(p.read_text() for p in sorted((cnn_dirs / "w").glob("*.wat")))
    for text in present:
        assert text in wat
    for text in absent:
        assert text not in wat


@pytest.mark.parametrize("argv,fragments", [
    (["--features", "simd,tail-call"], ["unknown --features tail-call"]),
    (["--features", "relaxed-simd"], ["relaxed-simd needs simd"]),
    (["--target", "wasm64-unknown-unknown"], ["unknown --target 'wasm64-unknown-unknown'"]),
    (["--opt-level", "4"], ["unknown --opt-level '4'"]),
])
def test_bad_options_are_one_line_errors(cnn_dirs, argv, fragments):
    code, _, err = compile_cli(cnn_dirs, *argv, output="never")
    assert_one_line_error(code, err, *fragments)
    assert not (cnn_dirs / "never").exists()


def test_unsupported_ops_are_listed_and_the_output_folder_is_untouched(tmp_path):
    model = make_model([helper.make_node("Abs", ["x"], ["r"], name="abs"),
                        helper.make_node("TfIdfVectorizer", ["r"], ["d"], name="count_ngrams", mode="TF",
                                         min_gram_length=1, max_gram_length=1, max_skip_count=0, ngram_counts=[0],
                                         ngram_indexes=[0, 1, 2], pool_int64s=[2, 3, 5])],
                       [helper.make_tensor_value_info("x", T.INT64, [2, 6])],
                       [helper.make_tensor_value_info("d", T.FLOAT, [2, 3])], opset=18)
    onnx.save(model, tmp_path / "m.onnx")
    assert run_cli(["decompose", "--model-path", str(tmp_path / "m.onnx"), "--output-dir", str(tmp_path / "cus"),
                    "--json"])[0] == 0
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "keep.txt").write_text("previous build")
    code, _, err = run_cli(["compile-wasm", "--cu-dir", str(tmp_path / "cus"), "--output", str(tmp_path / "bin")])
    assert_one_line_error(code, err, "TfIdfVectorizer (count_ngrams)")
    assert [p.name for p in (tmp_path / "bin").iterdir()] == ["keep.txt"]


def test_stale_dag_is_refused(cnn_dirs, tmp_path):
    dag = json.loads((cnn_dirs / "dag.json").read_text())
    dag["cus"][0]["sha256"] = "0" * 64
    (tmp_path / "dag.json").write_text(json.dumps(dag))
    code, _, err = compile_cli(cnn_dirs, "--dag", str(tmp_path / "dag.json"), output="stale")
    assert_one_line_error(code, err, "does not describe the CUs", "build-dag")


def test_missing_cu_dir_is_a_one_line_error(tmp_path):
    code, _, err = run_cli(["compile-wasm", "--cu-dir", str(tmp_path / "nope"), "--output", str(tmp_path / "b")])
    assert_one_line_error(code, err, "nope")


def test_options_parse_into_a_sorted_feature_set():
    options = parse_options(None, "relaxed-simd, simd", "3")
    assert options.features == ("relaxed-simd", "simd") and options.vectorize and options.relaxed_simd
    assert not parse_options(None, "", "3").vectorize
    with pytest.raises(CortexError):
        parse_options("x86_64", None, None)


def test_weights_live_in_data_segments_not_code(tmp_path):
    """A module's size grows with its weights by their bytes, not by WAT-escaped text."""
    weights = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [helper.make_tensor_value_info("x", T.FLOAT, [1, 256])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [1, 256])],
                       [onnx.numpy_helper.from_array(weights, "w")])
    onnx.save(model, tmp_path / "m.onnx")
    dag_path = compile_pipeline(tmp_path / "m.onnx", tmp_path / "out", opt_level="0")   # 0: no GEMM panel packing
    record = json.loads(dag_path.read_text())["cus"][0]["artifacts"]["wasm"]
    assert weights.nbytes < record["bytes"] < weights.nbytes + 16384
    assert weights.tobytes() in (dag_path.parent / record["path"]).read_bytes()


def test_compiling_twice_in_one_process_gives_the_same_bytes():
    """Names in the module come from positions, never from object identities or counters."""
    from backends.wasm.compile import compile_graph
    from ir.onnx_import import import_model
    from passes import optimize_pipeline, run_pipeline
    model = make_model([helper.make_node("Softmax", ["x"], ["s"]), helper.make_node("ReduceMean", ["s"], ["y"], axes=[1])],
                       [helper.make_tensor_value_info("x", T.FLOAT, [4, 8])], [helper.make_tensor_value_info("y", T.FLOAT, None)])
    builds = []
    for _ in range(2):
        graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
        builds.append(compile_graph(graph, parse_options(None, None, "2")).wasm)
    assert builds[0] == builds[1]
