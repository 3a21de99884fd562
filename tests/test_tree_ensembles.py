"""Tree ensembles (ai.onnx.ml TreeEnsembleRegressor, TreeEnsembleClassifier, TreeEnsemble) expand
into standard ops and match onnxruntime on wasm: random forests written as skl2onnx and onnxmltools
write them (per-tree node ids, string modes, leaf targets by (tree, node)), with every aggregate,
post transform, missing-value rule and branch mode, over float and double features."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cortex
from backends.cuda import toolchain as cuda_compile
from bench.conformance.run_case import run_case
from cli_helpers import assert_one_line_error, run_cli
from cuda_cases import run_cuda_sim
from testdata import run_onnxruntime
from wasm_cases import compile_pipeline

ML = "ai.onnx.ml"
FEATURES = 5


def random_tree(rng, depth: int, mode: str):
    """Nodes of one tree in preorder: (feature, split, mode, true id, false id), a leaf's mode LEAF."""
    nodes = []

    def grow(level):
        k = len(nodes)
        nodes.append(None)
        if level == depth or (level > 1 and rng.random() < 0.25):
            nodes[k] = (0, 0.0, "LEAF", 0, 0)
            return k
        feature, split = int(rng.integers(FEATURES)), float(np.round(rng.standard_normal(), 2))
        true_id = grow(level + 1)
        false_id = grow(level + 1)
        nodes[k] = (feature, split, mode if mode != "mixed" else
                    str(rng.choice(["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT"])), true_id, false_id)
        return k
    grow(0)
    return nodes


def forest_attributes(rng, trees: int, depth: int, targets: int, mode: str = "BRANCH_LEQ",
                      missing: bool = False, as_tensor: bool = False) -> dict:
    """TreeEnsembleRegressor's attributes for a random forest (each leaf adds to 1 or 2 targets)."""
    a = {k: [] for k in ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_values", "nodes_modes",
                         "nodes_truenodeids", "nodes_falsenodeids", "nodes_missing_value_tracks_true",
                         "target_treeids", "target_nodeids", "target_ids", "target_weights")}
    for t in range(trees):
        for i, (feature, split, m, true_id, false_id) in enumerate(random_tree(rng, depth, mode)):
            for key, value in (("nodes_treeids", t), ("nodes_nodeids", i), ("nodes_featureids", feature),
                               ("nodes_values", split), ("nodes_modes", m), ("nodes_truenodeids", true_id),
                               ("nodes_falsenodeids", false_id),
                               ("nodes_missing_value_tracks_true", int(missing and rng.random() < 0.5))):
                a[key].append(value)
            if m == "LEAF":
                for target in rng.choice(targets, size=min(targets, int(rng.integers(1, 3))), replace=False):
                    a["target_treeids"].append(t), a["target_nodeids"].append(i)
                    a["target_ids"].append(int(target)), a["target_weights"].append(float(np.round(rng.standard_normal(), 3)))
    if not missing:
        del a["nodes_missing_value_tracks_true"]
    if as_tensor:
        a["nodes_values_as_tensor"] = onnx.numpy_helper.from_array(np.array(a.pop("nodes_values"), np.float64))
        a["target_weights_as_tensor"] = onnx.numpy_helper.from_array(np.array(a.pop("target_weights"), np.float64))
    return a


def ml_model(op: str, x_type, rows: int, outputs: list[tuple[str, int, list]], ml_opset: int, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, ["X"], [name for name, _, _ in outputs], name="forest", domain=ML, **attrs)
    graph = helper.make_graph([node], "forest", [helper.make_tensor_value_info("X", x_type, [rows, FEATURES])],
                              [helper.make_tensor_value_info(name, t, shape) for name, t, shape in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, ml_opset)])


def features(rng, dtype, rows: int = 64, nans: bool = False) -> np.ndarray:
    x = np.round(rng.standard_normal((rows, FEATURES)), 2)        # rounded: some equal a split
    if nans:
        x[rng.random(x.shape) < 0.15] = np.nan
    return (x * 3).astype(dtype) if np.issubdtype(dtype, np.integer) else x.astype(dtype)


def run_on_wasm(model: onnx.ModelProto, feeds: dict, tmp_path) -> dict:
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    return cortex.load(compile_pipeline(path, tmp_path, min_cu_size=1), device="wasm").run(feeds)


REGRESSORS = {  # name -> (forest options, aggregate, post transform, base values, X type, ml opset)
    "sum-float": (dict(trees=6, depth=4, targets=1), "SUM", "NONE", None, np.float32, 1),
    "average-three-targets-base": (dict(trees=5, depth=5, targets=3), "AVERAGE", "NONE", [0.5, -1.0, 2.0], np.float32, 1),
    "min": (dict(trees=4, depth=3, targets=2), "MIN", "NONE", None, np.float32, 1),
    "max-logistic": (dict(trees=4, depth=3, targets=2), "MAX", "LOGISTIC", None, np.float32, 1),
    "softmax-mixed-modes": (dict(trees=5, depth=4, targets=3, mode="mixed"), "SUM", "SOFTMAX", None, np.float32, 1),
    "missing-values-nan-features": (dict(trees=5, depth=4, targets=1, missing=True), "SUM", "NONE", None, np.float32, 1),
    "double-as-tensor-opset3": (dict(trees=5, depth=4, targets=2, as_tensor=True), "SUM", "NONE", None, np.float64, 3),
    "double-missing-values-opset3": (dict(trees=4, depth=4, targets=2, missing=True), "SUM", "NONE", None, np.float64, 3),
    "one-deep-tree": (dict(trees=1, depth=12, targets=1), "SUM", "NONE", None, np.float32, 1),
    "one-target-base-logistic": (dict(trees=4, depth=4, targets=1), "AVERAGE", "LOGISTIC", [0.25], np.float32, 1),
    "min-one-target-base": (dict(trees=4, depth=3, targets=1), "MIN", "NONE", [1.5], np.float32, 1),
}


@pytest.mark.parametrize("case", REGRESSORS, ids=str)
def test_tree_ensemble_regressor_matches_onnxruntime(case, tmp_path):
    options, aggregate, post, base, dtype, opset = REGRESSORS[case]
    rng = np.random.default_rng(len(case))
    attrs = forest_attributes(rng, **options)
    if base is not None:
        attrs["base_values"] = base
    targets = options["targets"]
    model = ml_model("TreeEnsembleRegressor", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), 64,
                     [("Y", TensorProto.FLOAT, [64, targets])], opset, n_targets=targets, aggregate_function=aggregate,
                     post_transform=post, **attrs)
    feeds = {"X": features(rng, dtype, nans=options.get("missing", False))}
    want = run_onnxruntime(model, feeds)["Y"]
    got = run_on_wasm(model, feeds, tmp_path)["Y"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(np.unique(np.round(want, 4))) > 3, "the forest gives almost one value: a weak case"


def as_tree_ensemble(rng, trees: int, depth: int, targets: int, members: bool = False, missing: bool = False) -> dict:
    """TreeEnsemble (ai.onnx.ml 5) attributes of a random forest: leaves apart, one target each,
    integer modes (some BRANCH_MEMBER with sets of feature values when `members`)."""
    a = {k: [] for k in ("nodes_featureids", "nodes_splits", "nodes_modes", "nodes_truenodeids", "nodes_trueleafs",
                         "nodes_falsenodeids", "nodes_falseleafs", "nodes_missing_value_tracks_true",
                         "leaf_targetids", "leaf_weights", "tree_roots", "membership_values")}
    for _ in range(trees):
        nodes = random_tree(rng, depth, "BRANCH_LEQ")
        branch_ids, leaf_ids = {}, {}
        for i, n in enumerate(nodes):
            (leaf_ids if n[2] == "LEAF" else branch_ids)[i] = len(a["leaf_weights"]) + len(leaf_ids) \
                if n[2] == "LEAF" else len(a["nodes_modes"]) + len(branch_ids)
        a["tree_roots"].append(branch_ids[0])
        for i, (feature, split, _, true_id, false_id) in enumerate(nodes):
            if i in leaf_ids:
                a["leaf_targetids"].append(int(rng.integers(targets)))
                a["leaf_weights"].append(float(np.round(rng.standard_normal(), 3)))
                continue
            member = members and rng.random() < 0.3
            a["nodes_featureids"].append(feature), a["nodes_splits"].append(split)
            a["nodes_modes"].append(6 if member else int(rng.choice([0, 1, 2, 3])))
            if member:
                # categories: onnxruntime takes only whole numbers as members, and non-negative ones exactly
                a["membership_values"] += [float(v) for v in rng.integers(0, 6, 3)] + [float("nan")]
            for side, child in (("true", true_id), ("false", false_id)):
                a[f"nodes_{side}leafs"].append(int(child in leaf_ids))
                a[f"nodes_{side}nodeids"].append(leaf_ids.get(child, branch_ids.get(child)))
            a["nodes_missing_value_tracks_true"].append(int(missing and rng.random() < 0.5))
    a["nodes_splits"] = onnx.numpy_helper.from_array(np.array(a["nodes_splits"], np.float32))
    a["leaf_weights"] = onnx.numpy_helper.from_array(np.array(a["leaf_weights"], np.float32))
    a["nodes_modes"] = onnx.numpy_helper.from_array(np.array(a["nodes_modes"], np.uint8))
    if members:
        a["membership_values"] = onnx.numpy_helper.from_array(np.array(a["membership_values"], np.float32))
    else:
        del a["membership_values"]
    if not missing:
        del a["nodes_missing_value_tracks_true"]
    return a


# name -> (forest options, aggregate (0 AVERAGE, 1 SUM, 2 MIN, 3 MAX), post transform as onnxruntime
# reads it (0 NONE, 1 LOGISTIC, 2 SOFTMAX))
ENSEMBLES = {
    "sum-two-targets": (dict(trees=5, depth=4, targets=2), 1, 0),
    "average-member-sets": (dict(trees=4, depth=4, targets=1, members=True), 0, 0),
    "max-missing-values": (dict(trees=4, depth=4, targets=3, missing=True), 3, 0),
    "min-logistic": (dict(trees=4, depth=3, targets=3), 2, 1),
    "sum-softmax-member-sets": (dict(trees=6, depth=5, targets=2, members=True), 1, 2),
}


@pytest.mark.parametrize("case", ENSEMBLES, ids=str)
def test_tree_ensemble_matches_onnxruntime(case, tmp_path):
    options, aggregate, post = ENSEMBLES[case]
    rng = np.random.default_rng(len(case) + 100)
    attrs = as_tree_ensemble(rng, **options)
    targets = options["targets"]
    model = ml_model("TreeEnsemble", TensorProto.FLOAT, 64, [("Y", TensorProto.FLOAT, [64, targets])], 5,
                     n_targets=targets, aggregate_function=aggregate, post_transform=post, **attrs)
    model.opset_import[0].version = 21
    x = features(rng, np.float32, nans=options.get("missing", False))
    if options.get("members"):     # half the rows hold whole numbers, some of them a set's members
        x[::2, :] = rng.integers(0, 6, size=x[::2, :].shape)
    feeds = {"X": x}
    want = run_onnxruntime(model, feeds)["Y"]
    got = run_on_wasm(model, feeds, tmp_path)["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(np.unique(np.round(want, 4))) > 3, "the forest gives almost one value: a weak case"


def classifier_attributes(rng, trees: int, depth: int, classes_weighted: int, positive: bool = False) -> dict:
    """TreeEnsembleClassifier's attributes: forest_attributes with class_* for target_* (weights on
    `classes_weighted` class ids; all positive when `positive`, as a random forest's probabilities)."""
    a = forest_attributes(rng, trees, depth, classes_weighted)
    for key in ("treeids", "nodeids", "ids", "weights"):
        a[f"class_{key}"] = a.pop(f"target_{key}")
    if positive:
        a["class_weights"] = [abs(w) for w in a["class_weights"]]
    return a


CLASSIFIERS = {  # name -> (labels, class ids weighted, all weights positive, base values, post transform)
    "three-classes": ([0, 1, 2], 3, False, None, "NONE"),
    "four-labels-softmax-base": ([3, 5, 7, 11], 4, False, [0.1, -0.2, 0.3, 0.0], "SOFTMAX"),
    "three-classes-logistic-positive": ([1, 2, 3], 3, True, None, "LOGISTIC"),
    "binary-both-classes-probabilities": ([0, 1], 2, True, None, "NONE"),
    "binary-both-classes-one-base-value": ([0, 1], 2, False, [0.2], "SOFTMAX"),
    "binary-both-classes-two-base-values": ([0, 1], 2, False, [0.25, -0.25], "NONE"),
    "binary-one-class-logistic-base": ([0, 1], 1, False, [0.3], "LOGISTIC"),
    "binary-one-class-margins": ([4, 9], 1, False, None, "NONE"),
    "binary-one-class-positive": ([0, 1], 1, True, None, "NONE"),
}


@pytest.mark.parametrize("case", CLASSIFIERS, ids=str)
def test_tree_ensemble_classifier_matches_onnxruntime(case, tmp_path):
    labels, weighted, positive, base, post = CLASSIFIERS[case]
    rng = np.random.default_rng(len(case) + 200)
    attrs = classifier_attributes(rng, 6, 4, weighted, positive)
    if base is not None:
        attrs["base_values"] = base
    model = ml_model("TreeEnsembleClassifier", TensorProto.FLOAT, 64,
                     [("Y", TensorProto.INT64, [64]), ("Z", TensorProto.FLOAT, [64, len(labels)])], 1,
                     classlabels_int64s=labels, post_transform=post, **attrs)
    feeds = {"X": features(rng, np.float32)}
    want = run_onnxruntime(model, feeds)
    got = run_on_wasm(model, feeds, tmp_path)
    np.testing.assert_array_equal(got["Y"], want["Y"])
    np.testing.assert_allclose(got["Z"], want["Z"], rtol=1e-5, atol=1e-6)
    assert len(np.unique(np.round(want["Z"], 4))) > 8, "almost one score for every row: a weak case"


def test_a_classifier_with_string_labels_is_one_line_naming_the_node(tmp_path):
    rng = np.random.default_rng(5)
    attrs = classifier_attributes(rng, 2, 3, 2)
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["Y", "Z"], name="forest", domain=ML,
                            classlabels_strings=["cat", "dog"], **attrs)
    graph = helper.make_graph([node], "forest", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, FEATURES])],
                              [helper.make_tensor_value_info("Y", TensorProto.STRING, [4]),
                               helper.make_tensor_value_info("Z", TensorProto.FLOAT, [4, 2])])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)]), path)
    code, _, err = run_cli(["decompose", "--model-path", path, "--output-dir", tmp_path / "cus"])
    assert_one_line_error(code, err, "'Y' is a string tensor", "'forest'", "string class labels")
    assert not (tmp_path / "cus").exists()


@pytest.mark.parametrize("name", ["test_ai_onnx_ml_tree_ensemble_single_tree",
                                  "test_ai_onnx_ml_tree_ensemble_set_membership"])
def test_the_onnx_node_tests_of_tree_ensemble_pass(name):
    """Their model imports no default opset (only ai.onnx.ml), which the expansion's body then brings."""
    result = run_case(name, "wasm")
    assert result.outcome == "passed", f"{result.outcome} at {result.stage}: {result.why}"


@pytest.mark.skipif(cuda_compile.find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("case", ["min", "softmax-mixed-modes"])
def test_tree_ensemble_regressor_matches_onnxruntime_on_cuda_sim(case):
    options, aggregate, post, _, dtype, opset = REGRESSORS[case]
    rng = np.random.default_rng(len(case))
    targets = options["targets"]
    model = ml_model("TreeEnsembleRegressor", TensorProto.FLOAT, 64, [("Y", TensorProto.FLOAT, [64, targets])], opset,
                     n_targets=targets, aggregate_function=aggregate, post_transform=post,
                     **forest_attributes(rng, **options))
    feeds = {"X": features(rng, dtype)}
    np.testing.assert_allclose(run_cuda_sim(model, feeds)["Y"], run_onnxruntime(model, feeds)["Y"], rtol=1e-5, atol=1e-6)
