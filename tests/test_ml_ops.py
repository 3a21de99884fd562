"""ai.onnx.ml preprocessing and linear models (what skl2onnx writes around a model: Scaler,
Normalizer, Imputer, OneHotEncoder, LabelEncoder, LinearRegressor, LinearClassifier) expand into
standard ops and match onnxruntime on wasm, its conventions included (a zero-norm row, NaN as the
replaced value, the binary classifier with one row of coefficients)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cortex
from cli_helpers import assert_one_line_error, first_failure, run_cli
from testdata import run_onnxruntime
from wasm_cases import compile_pipeline

ML = "ai.onnx.ml"
RNG = np.random.default_rng(11)
X = np.round(RNG.standard_normal((16, 4)), 2).astype(np.float32)
X[3] = 0.0                                      # a row whose norm is 0
X_NAN = X.copy()
X_NAN[RNG.random(X.shape) < 0.2] = np.nan
CATS = RNG.integers(0, 6, (16, 3)).astype(np.int64)


def ml_model(op: str, x: np.ndarray, outputs: list[tuple[str, int]], ml_opset: int = 1, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, ["X"], [name for name, _ in outputs], name=op.lower(), domain=ML, **attrs)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("X", helper.np_dtype_to_tensor_dtype(x.dtype),
                                                                           list(x.shape))],
                              [helper.make_tensor_value_info(name, t, None) for name, t in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, ml_opset)])


def run_on_wasm(model: onnx.ModelProto, feeds: dict, tmp_path) -> dict:
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    return cortex.load(compile_pipeline(path, tmp_path, min_cu_size=1), device="wasm").run(feeds)


FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
W3 = list(np.round(RNG.standard_normal(12), 2))            # three rows of four coefficients
CASES = {  # name -> (op, X, outputs, ml opset, attributes)
    "scaler-per-feature": ("Scaler", X, [("Y", FLOAT)], 1, dict(offset=[0.5, 0.0, -1.0, 2.0], scale=[2.0, 0.5, 1.0, -1.0])),
    "scaler-one-value-int64": ("Scaler", CATS, [("Y", FLOAT)], 1, dict(offset=[1.0], scale=[0.5])),
    "normalizer-max": ("Normalizer", X, [("Y", FLOAT)], 1, dict(norm="MAX")),
    "normalizer-l1": ("Normalizer", X, [("Y", FLOAT)], 1, dict(norm="L1")),
    "normalizer-l2": ("Normalizer", X, [("Y", FLOAT)], 1, dict(norm="L2")),
    "imputer-nan-per-feature": ("Imputer", X_NAN, [("Y", FLOAT)], 1,
                                dict(imputed_value_floats=[1.0, 2.0, 3.0, 4.0], replaced_value_float=float("nan"))),
    "imputer-zero-one-value": ("Imputer", X, [("Y", FLOAT)], 1, dict(imputed_value_floats=[9.0], replaced_value_float=0.0)),
    "imputer-int64": ("Imputer", CATS, [("Y", INT64)], 1, dict(imputed_value_int64s=[7], replaced_value_int64=2)),
    "one-hot-encoder": ("OneHotEncoder", CATS, [("Y", FLOAT)], 1, dict(cats_int64s=[0, 2, 3, 5], zeros=1)),
    "label-encoder-int64": ("LabelEncoder", CATS, [("Y", INT64)], 2,
                            dict(keys_int64s=[0, 1, 2, 5], values_int64s=[10, 11, 12, 15], default_int64=-7)),
    "label-encoder-int64-to-float": ("LabelEncoder", CATS, [("Y", FLOAT)], 2,
                                     dict(keys_int64s=[1, 3], values_floats=[0.5, -1.5], default_float=2.5)),
    "linear-regressor-two-targets": ("LinearRegressor", X, [("Y", FLOAT)], 1,
                                     dict(coefficients=W3[:8], intercepts=[0.5, -0.25], targets=2)),
    "linear-classifier-three-classes": ("LinearClassifier", X, [("Y", INT64), ("Z", FLOAT)], 1,
                                        dict(coefficients=W3, intercepts=[0.1, -0.2, 0.0], classlabels_ints=[4, 5, 9])),
    "linear-classifier-softmax": ("LinearClassifier", X, [("Y", INT64), ("Z", FLOAT)], 1,
                                  dict(coefficients=W3, intercepts=[0.1, -0.2, 0.0], classlabels_ints=[0, 1, 2],
                                       post_transform="SOFTMAX")),
    "linear-classifier-logistic": ("LinearClassifier", X, [("Y", INT64), ("Z", FLOAT)], 1,
                                   dict(coefficients=W3, intercepts=[0.1, -0.2, 0.0], classlabels_ints=[0, 1, 2],
                                        post_transform="LOGISTIC")),
    "linear-classifier-binary-one-row": ("LinearClassifier", X, [("Y", INT64), ("Z", FLOAT)], 1,
                                         dict(coefficients=W3[:4], intercepts=[0.1], classlabels_ints=[3, 8])),
    "linear-classifier-binary-one-row-logistic": ("LinearClassifier", X, [("Y", INT64), ("Z", FLOAT)], 1,
                                                  dict(coefficients=W3[:4], intercepts=[-0.3], classlabels_ints=[0, 1],
                                                       post_transform="LOGISTIC")),
    "linear-classifier-binary-two-rows": ("LinearClassifier", X, [("Y", INT64), ("Z", FLOAT)], 1,
                                          dict(coefficients=W3[:8], intercepts=[0.1, 0.0], classlabels_ints=[0, 1])),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ml_op_matches_onnxruntime_on_wasm(case, tmp_path):
    op, x, outputs, opset, attrs = CASES[case]
    model = ml_model(op, x, outputs, opset, **attrs)
    feeds = {"X": x}
    want = run_onnxruntime(model, feeds)
    got = run_on_wasm(model, feeds, tmp_path)
    for name, expected in want.items():
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)
        assert len(np.unique(expected)) > 1, f"{name}: one value for every element, a weak case"


def test_a_pipeline_of_scaler_imputer_and_classifier_matches_onnxruntime(tmp_path):
    """skl2onnx's shape of a scikit-learn pipeline: impute, scale, classify (with probabilities)."""
    nodes = [helper.make_node("Imputer", ["X"], ["imputed"], domain=ML, imputed_value_floats=[0.1, 0.2, 0.3, 0.4],
                              replaced_value_float=float("nan")),
             helper.make_node("Scaler", ["imputed"], ["scaled"], domain=ML, offset=[0.0, 0.1, -0.1, 0.2],
                              scale=[1.5, 0.5, 2.0, 1.0]),
             helper.make_node("LinearClassifier", ["scaled"], ["label", "probabilities"], domain=ML,
                              coefficients=W3, intercepts=[0.1, -0.2, 0.0], classlabels_ints=[0, 1, 2],
                              post_transform="SOFTMAX"),
             helper.make_node("Normalizer", ["probabilities"], ["normalized"], domain=ML, norm="L1")]
    graph = helper.make_graph(nodes, "pipeline", [helper.make_tensor_value_info("X", FLOAT, [16, 4])],
                              [helper.make_tensor_value_info("label", INT64, [16]),
                               helper.make_tensor_value_info("normalized", FLOAT, [16, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)])
    feeds = {"X": X_NAN}
    want, got = run_onnxruntime(model, feeds), run_on_wasm(model, feeds, tmp_path)
    np.testing.assert_array_equal(got["label"], want["label"])
    np.testing.assert_allclose(got["normalized"], want["normalized"], rtol=1e-5, atol=1e-6)


def test_string_categories_are_one_line_naming_the_node(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(ml_model("OneHotEncoder", CATS, [("Y", FLOAT)], cats_strings=["a", "b"]), path)
    # The node stays unexpanded (a fallback CU could run it); compile-wasm says why it has no lowering.
    command, code, err = first_failure(path, tmp_path)
    assert command == "compile-wasm"
    assert_one_line_error(code, err, "OneHotEncoder (onehotencoder: ", "string categories", "--fallback onnxruntime")
    assert not (tmp_path / "wasm").exists()


SV = np.round(RNG.standard_normal((7, 4)), 2)
SV_COEF = np.round(RNG.standard_normal((3, 7)), 2)
KERNELS = {"LINEAR": [0.0, 0.0, 0.0], "POLY": [0.4, 0.5, 3.0], "RBF": [0.8, 0.0, 0.0], "SIGMOID": [0.2, -0.1, 0.0]}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("classes", [2, 4])
def test_svm_classifier_matches_onnxruntime(kernel, classes, tmp_path):
    per_class = [4, 3] if classes == 2 else [2, 2, 2, 1]
    pairs = classes * (classes - 1) // 2
    attrs = dict(kernel_type=kernel, kernel_params=KERNELS[kernel], support_vectors=SV.ravel().tolist(),
                 vectors_per_class=per_class, coefficients=SV_COEF[:classes - 1].ravel().tolist(),
                 rho=list(np.round(0.1 * RNG.standard_normal(pairs), 2)), classlabels_ints=list(range(10, 10 + classes)))
    model = ml_model("SVMClassifier", X, [("Y", INT64), ("Z", FLOAT)], **attrs)
    feeds = {"X": X}
    want, got = run_onnxruntime(model, feeds), run_on_wasm(model, feeds, tmp_path)
    np.testing.assert_array_equal(got["Y"], want["Y"])
    np.testing.assert_allclose(got["Z"], want["Z"], rtol=1e-4, atol=1e-5)
    assert len(np.unique(want["Y"])) > 1, "one label for every row: a weak case"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("one_class", [0, 1])
def test_svm_regressor_matches_onnxruntime(kernel, one_class, tmp_path):
    attrs = dict(kernel_type=kernel, kernel_params=KERNELS[kernel], support_vectors=SV.ravel().tolist(), n_supports=7,
                 coefficients=SV_COEF[0].tolist(), rho=[0.2], one_class=one_class)
    model = ml_model("SVMRegressor", X, [("Y", FLOAT)], **attrs)
    feeds = {"X": X}
    want, got = run_onnxruntime(model, feeds)["Y"], run_on_wasm(model, feeds, tmp_path)["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert len(np.unique(want)) > 1, "one value for every row: a weak case"


def test_svm_classifier_with_probabilities_is_one_line_naming_the_node(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(ml_model("SVMClassifier", X, [("Y", INT64), ("Z", FLOAT)], kernel_type="RBF", kernel_params=[0.3, 0, 0],
                       support_vectors=SV.ravel().tolist(), vectors_per_class=[4, 3], coefficients=SV_COEF[0].tolist(),
                       rho=[0.1], classlabels_ints=[0, 1], prob_a=[-1.0], prob_b=[0.1]), path)
    # ONNX has no shape rule for an unexpanded SVMClassifier: the shape error says why it stays so.
    command, code, err = first_failure(path, tmp_path)
    assert command == "decompose"
    assert_one_line_error(code, err, "svmclassifier", "cannot infer a static shape", "stays unexpanded", "prob_a")


def test_a_zipmap_output_is_one_line_that_says_how_to_convert_without_it(tmp_path):
    """skl2onnx's default classifier ends in ZipMap, a sequence of maps, which no CU can return."""
    nodes = [helper.make_node("LinearClassifier", ["X"], ["label", "probabilities"], domain=ML, coefficients=W3,
                              intercepts=[0.0, 0.1, 0.2], classlabels_ints=[0, 1, 2], post_transform="SOFTMAX"),
             helper.make_node("ZipMap", ["probabilities"], ["output_probability"], name="zipmap", domain=ML,
                              classlabels_int64s=[0, 1, 2])]
    maps = helper.make_sequence_type_proto(helper.make_map_type_proto(INT64, helper.make_tensor_type_proto(FLOAT, [])))
    graph = helper.make_graph(nodes, "zipmap", [helper.make_tensor_value_info("X", FLOAT, [16, 4])],
                              [helper.make_tensor_value_info("label", INT64, [16]),
                               helper.make_value_info("output_probability", maps)])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)]), path)
    code, _, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "'output_probability'", "ZipMap", "'zipmap': False")
    assert not (tmp_path / "cus").exists()
