"""ai.onnx.ml tree ensembles: TreeEnsembleRegressor and TreeEnsembleClassifier (ml opsets 1 and 3)
and TreeEnsemble (5), what skl2onnx, onnxmltools and hummingbird write for random forests and
gradient-boosted trees, expanded into standard ops.

Every tree of every row walks one level per step, as Gathers from constant tables of its nodes,
for as many steps as the deepest tree has branch levels (a leaf points at itself). So the walk is
tensor arithmetic that every target lowers, with no data-dependent loop. Scores, labels and their
corner cases follow onnxruntime's aggregators (onnxruntime/core/providers/cpu/ml/
tree_ensemble_aggregator.h), computed in the features' float type.
"""

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from ir.errors import NeedsShapes, NotExpanded, UnsupportedError
from ir.ops.function_body import Body
from ir.ops.ml import ML, floats, text
from ir.ops.registry import OTHER, register

MODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ", "BRANCH_MEMBER")
LEAF = "LEAF"
COMPARE = {"BRANCH_LEQ": "LessOrEqual", "BRANCH_LT": "Less", "BRANCH_GTE": "GreaterOrEqual",
           "BRANCH_GT": "Greater", "BRANCH_EQ": "Equal"}
AGGREGATES = ("AVERAGE", "SUM", "MIN", "MAX")
# TreeEnsemble's post_transform codes as onnxruntime reads them (its own enum: 1 is LOGISTIC and 2
# SOFTMAX, where the ONNX spec says the reverse); ONNX's reference evaluator applies none.
ENSEMBLE_POST_TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT")


@dataclass
class Forest:
    """A tree ensemble as tables over one index space of its nodes, leaves included."""
    feature: np.ndarray       # int64 per node (0 for a leaf)
    split: np.ndarray         # float64 per node
    mode: list[str]           # per node, LEAF for a leaf
    missing_true: np.ndarray  # bool per node: a NaN feature takes the true branch
    true_child: np.ndarray    # int64 per node (a leaf: itself)
    false_child: np.ndarray
    members: dict[int, list[float]]   # BRANCH_MEMBER nodes: their set
    leaf_values: np.ndarray   # float64 [nodes, targets]: what each leaf adds to each target
    contributes: np.ndarray   # bool [nodes, targets]: whether it adds to that target
    roots: np.ndarray         # int64 per tree
    aggregate: str
    base_values: np.ndarray   # float64, usually one per target (onnxruntime ignores other lengths)
    post_transform: str

    def __post_init__(self):
        for k, m in enumerate(self.mode):    # steps past a tree's depth stay on its leaf
            if m == LEAF:
                self.true_child[k] = self.false_child[k] = k

    def depth(self, node) -> int:
        """Steps that take every root to its leaf: the number of branch nodes on the longest path."""
        depth, frontier = 0, {int(r) for r in self.roots}
        while True:
            branches = {n for n in frontier if self.mode[n] != LEAF}
            if not branches:
                return depth
            depth += 1
            if depth > len(self.mode):
                raise UnsupportedError(f"{node.describe()}: a tree of the ensemble has a cycle")
            frontier = {int(self.true_child[n]) for n in branches} | {int(self.false_child[n]) for n in branches}


def _attr(node, name: str, default=None):
    value = node.attrs.get(name, default)
    return np.asarray(value) if isinstance(value, (list, tuple)) else value


def forest_of_nodes(node, leaf: str, targets: int, aggregate: str) -> Forest:
    """TreeEnsembleRegressor's or TreeEnsembleClassifier's per-tree node ids, string modes and leaf
    weights by (tree, node) (`leaf`: the prefix of those, target or class) as a Forest."""
    trees, ids = _attr(node, "nodes_treeids"), _attr(node, "nodes_nodeids")
    if trees is None or ids is None or _attr(node, "nodes_modes") is None:
        raise UnsupportedError(f"{node.describe()}: a tree ensemble needs nodes_treeids, nodes_nodeids and nodes_modes")
    index = {(int(t), int(i)): k for k, (t, i) in enumerate(zip(trees, ids))}
    modes = [text(m) for m in _attr(node, "nodes_modes")]
    unknown = sorted({m for m in modes if m != LEAF and m not in MODES[:6]})
    if unknown:
        raise NotExpanded(f"{node.describe()}: node mode(s) {', '.join(unknown)} are not supported")

    def child(name):
        try:
            return np.array([index[(int(t), int(c))] if m != LEAF else k
                             for k, (t, c, m) in enumerate(zip(trees, _attr(node, name), modes))], np.int64)
        except KeyError as e:
            raise UnsupportedError(f"{node.describe()}: {name} names node {e.args[0]} (tree, node), which does "
                                   "not exist") from None
    values, contributes = np.zeros((len(index), targets)), np.zeros((len(index), targets), bool)
    for t, i, target, weight in zip(_attr(node, f"{leaf}_treeids"), _attr(node, f"{leaf}_nodeids"),
                                    _attr(node, f"{leaf}_ids"), floats(node, f"{leaf}_weights", dtype=np.float64)):
        values[index[(int(t), int(i))], int(target)] += weight
        contributes[index[(int(t), int(i))], int(target)] = True
    missing = _attr(node, "nodes_missing_value_tracks_true")
    roots = {}    # each tree's root: its node of the lowest id
    for (t, _), k in sorted(index.items()):
        roots.setdefault(t, k)
    return Forest(np.asarray(_attr(node, "nodes_featureids"), np.int64),
                  floats(node, "nodes_values", dtype=np.float64), modes,
                  np.asarray(missing if missing is not None else np.zeros(len(index)), bool),
                  child("nodes_truenodeids"), child("nodes_falsenodeids"), {}, values, contributes,
                  np.array([roots[t] for t in sorted(roots)], np.int64), aggregate,
                  floats(node, "base_values", np.zeros(0), dtype=np.float64),
                  text(node.attrs.get("post_transform", "NONE")))


def forest_of_tree_ensemble(node) -> Forest:
    """TreeEnsemble (ai.onnx.ml 5): branch nodes, then the leaves after them in one index space."""
    modes = [MODES[int(m)] if 0 <= int(m) < len(MODES) else str(m) for m in _attr(node, "nodes_modes")]
    branches, weights = len(modes), floats(node, "leaf_weights", dtype=np.float64)
    leaves, targets = len(weights), int(node.attrs["n_targets"])

    def child(ids, leaf_flags):
        return np.array([branches + int(c) if int(is_leaf) else int(c) for c, is_leaf in zip(ids, leaf_flags)], np.int64)
    members, values = {}, iter(np.asarray(_attr(node, "membership_values", []), np.float64).tolist())
    for k, m in enumerate(modes):
        if m == "BRANCH_MEMBER":
            members[k] = []
            for v in values:
                if np.isnan(v):
                    break
                members[k].append(v)
    leaf_values = np.zeros((branches + leaves, targets))
    contributes = np.zeros((branches + leaves, targets), bool)
    for k, (target, weight) in enumerate(zip(_attr(node, "leaf_targetids"), weights)):
        leaf_values[branches + k, int(target)] += weight
        contributes[branches + k, int(target)] = True
    missing = _attr(node, "nodes_missing_value_tracks_true")
    leaf_ids = branches + np.arange(leaves)
    return Forest(np.concatenate([np.asarray(_attr(node, "nodes_featureids"), np.int64), np.zeros(leaves, np.int64)]),
                  np.concatenate([floats(node, "nodes_splits", dtype=np.float64), np.zeros(leaves)]),
                  modes + [LEAF] * leaves,
                  np.concatenate([np.asarray(missing if missing is not None else np.zeros(branches), bool),
                                  np.zeros(leaves, bool)]),
                  np.concatenate([child(_attr(node, "nodes_truenodeids"), _attr(node, "nodes_trueleafs")), leaf_ids]),
                  np.concatenate([child(_attr(node, "nodes_falsenodeids"), _attr(node, "nodes_falseleafs")), leaf_ids]),
                  members, leaf_values, contributes, np.asarray(_attr(node, "tree_roots"), np.int64),
                  AGGREGATES[int(node.attrs.get("aggregate_function", 1))], np.zeros(0),
                  ENSEMBLE_POST_TRANSFORMS[int(node.attrs.get("post_transform", 0))])


class _Walk:
    """The body of one ensemble: X cast to its float type, and every tree's leaf for every row."""

    def __init__(self, node, forest: Forest, outputs: tuple[str, ...]):
        self.node, self.forest = node, forest
        value = node.inputs[0]
        if value is None or not value.dtype:
            raise NeedsShapes(f"{node.describe()}: the type of X is not known yet")
        x_dtype = helper.tensor_dtype_to_np_dtype(value.dtype).type
        self.dtype = x_dtype if x_dtype in (np.float32, np.float64) else np.float32
        self.body = Body(node, ("X",))
        self.outputs = outputs
        x = self.body.op("Cast", "X", to=self.onnx_type) if self.dtype != x_dtype else "X"
        self.leaves = self._walk(x)

    @property
    def onnx_type(self) -> int:
        return helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))

    def constant(self, value, dtype=None) -> str:
        return self.body.constant(value, self.dtype if dtype is None else dtype)

    def _walk(self, x: str) -> str:
        body, forest = self.body, self.forest
        depth = forest.depth(self.node)
        rows = body.op("Slice", body.op("Shape", x), self.constant([0], np.int64), self.constant([1], np.int64))
        at = body.op("Expand", self.constant(forest.roots.reshape(1, -1), np.int64),
                     body.op("Concat", rows, self.constant([len(forest.roots)], np.int64), axis=0))
        feature, split = self.constant(forest.feature, np.int64), self.constant(forest.split)
        true_child, false_child = self.constant(forest.true_child, np.int64), self.constant(forest.false_child, np.int64)
        modes = sorted({m for m in forest.mode if m != LEAF})
        mode_of = self.constant([MODES.index(m) if m != LEAF else -1 for m in forest.mode], np.int64) \
            if len(modes) > 1 else None
        for _ in range(depth):
            value = body.op("GatherElements", x, body.op("Gather", feature, at), axis=1)
            threshold = body.op("Gather", split, at)
            decided = None
            for m in modes:
                if m == "BRANCH_MEMBER":
                    cond = self._member(value, at)
                elif m == "BRANCH_NEQ":
                    cond = body.op("Not", body.op("Equal", value, threshold))
                else:
                    cond = body.op(COMPARE[m], value, threshold)
                if mode_of is not None:
                    this_mode = body.op("Equal", body.op("Gather", mode_of, at), self.constant(MODES.index(m), np.int64))
                    cond = body.op("And", this_mode, cond)
                    decided = cond if decided is None else body.op("Or", decided, cond)
                else:
                    decided = cond
            if forest.missing_true.any():
                tracks = body.op("Gather", self.constant(forest.missing_true, np.bool_), at)
                decided = body.op("Or", decided, body.op("And", tracks, body.op("IsNaN", value)))
            at = body.op("Where", decided, body.op("Gather", true_child, at), body.op("Gather", false_child, at))
        return at

    def _member(self, value: str, at: str) -> str:
        """Whether `value` is in the set of the member node `at` (the sets padded with NaN, equal to nothing)."""
        body, forest = self.body, self.forest
        sets = np.full((len(forest.mode), max(len(s) for s in forest.members.values())), np.nan)
        for k, members in forest.members.items():
            sets[k, :len(members)] = members
        hits = body.op("Equal", body.op("Unsqueeze", value, self.constant([-1], np.int64)),
                       body.op("Gather", self.constant(sets), at))
        found = body.op("ReduceSum", body.op("Cast", hits, to=TensorProto.FLOAT), self.constant([-1], np.int64),
                        keepdims=0)
        return body.op("Greater", found, self.constant(0.0, np.float32))

    def summed(self, table: np.ndarray) -> str:
        """[rows, targets]: `table` [nodes, targets] summed over the trees' leaves."""
        return self.body.op("ReduceSum", self.body.op("Gather", self.constant(table), self.leaves),
                            self.constant([1], np.int64), keepdims=0)

    def scores(self) -> tuple[str, str]:
        """(the aggregate per target, whether any tree adds to it) before base values."""
        body, forest = self.body, self.forest
        added = body.op("Greater", self.summed(forest.contributes.astype(np.float64)), self.constant(0.0))
        if forest.aggregate in ("SUM", "AVERAGE"):
            total = self.summed(forest.leaf_values)
            if forest.aggregate == "AVERAGE":
                total = body.op("Div", total, self.constant(float(len(forest.roots))))
            return total, added
        largest = forest.aggregate == "MAX"
        values = np.where(forest.contributes, forest.leaf_values, -np.inf if largest else np.inf)
        best = body.op("TopK", body.op("Gather", self.constant(values), self.leaves), self.constant([1], np.int64),
                       outputs=2, axis=1, largest=int(largest))[0]
        best = body.op("Squeeze", best, self.constant([1], np.int64))
        return body.op("Where", added, best, self.constant(0.0)), added

    def transformed(self, scores: str, out: str | None, out_dtype=None) -> str:
        """The post transform of `scores`, in `out_dtype` (default: the features' float type)."""
        final = {"NONE": "Identity", "SOFTMAX": "Softmax", "LOGISTIC": "Sigmoid"}[self.forest.post_transform]
        kept = out_dtype is None or np.dtype(out_dtype) == np.dtype(self.dtype)
        done = self.body.op(final, scores, out=out if kept else None, **({"axis": -1} if final == "Softmax" else {}))
        return done if kept else self.cast(done, out_dtype, out)

    def cast(self, value: str, dtype, out: str | None) -> str:
        if np.dtype(dtype) == np.dtype(self.dtype):
            return self.body.op("Identity", value, out=out)
        return self.body.op("Cast", value, to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), out=out)

    def function(self):
        return self.body.function(self.outputs)


def _regression(node, forest: Forest, out_dtype):
    """onnxruntime's regression aggregators: with several targets, a target no tree of the row adds
    to is 0 whatever its base value, then the post transform; with one target the base value always
    counts and onnxruntime applies no post transform."""
    targets = forest.leaf_values.shape[1]
    if forest.post_transform not in ("NONE", "SOFTMAX", "LOGISTIC") or forest.aggregate not in AGGREGATES:
        raise NotExpanded(f"{node.describe()}: post_transform {forest.post_transform} with aggregate_function "
                          f"{forest.aggregate} is not supported")
    walk = _Walk(node, forest, ("Y",))
    body = walk.body
    total, added = walk.scores()
    if targets == 1:
        origin = forest.base_values[0] if len(forest.base_values) == 1 else 0.0
        walk.cast(body.op("Add", total, walk.constant([origin])), out_dtype or walk.dtype, "Y")
        return walk.function()
    if len(forest.base_values) == targets:
        total = body.op("Add", total, walk.constant(forest.base_values))
    walk.transformed(body.op("Where", added, total, walk.constant(0.0)), "Y", out_dtype)
    return walk.function()


def _tree_ensemble_regressor(node):
    forest = forest_of_nodes(node, "target", int(node.attrs.get("n_targets", 1)),
                             text(node.attrs.get("aggregate_function", "SUM")))
    return _regression(node, forest, np.float32)     # Y is float whatever X is


def _tree_ensemble(node):
    return _regression(node, forest_of_tree_ensemble(node), None)   # Y has X's type


def _tree_ensemble_classifier(node):
    """Y (labels) and Z (scores) as onnxruntime's TreeAggregatorClassifier gives them: per class the
    sum of the leaves' weights; with more than two classes, base values added (a class no tree adds
    to then scores its base value), the label of the highest scoring class and the post transform
    over all classes; with two, onnxruntime's binary rules (`_binary`)."""
    labels = _attr(node, "classlabels_int64s")
    if labels is None:
        raise NotExpanded(f"{node.describe()}: TreeEnsembleClassifier with string class labels is not supported "
                          "(Cortex has no string tensors)")
    forest = forest_of_nodes(node, "class", len(labels), "SUM")
    if forest.post_transform not in ("NONE", "SOFTMAX", "LOGISTIC"):
        raise NotExpanded(f"{node.describe()}: post_transform {forest.post_transform} is not supported")
    walk = _Walk(node, forest, ("Y", "Z"))
    body = walk.body
    total, added = walk.scores()
    if len(labels) == 2:
        return _binary(node, walk, total, added, labels)
    base = np.zeros(len(labels))
    base[:len(forest.base_values)] = forest.base_values[:len(labels)]
    based = np.arange(len(labels)) < len(forest.base_values)
    if based.any():
        total = body.op("Add", total, walk.constant(base))
        added = body.op("Or", added, walk.constant(based, np.bool_))
    best = body.op("ArgMax", body.op("Where", added, total, walk.constant(-np.inf)), axis=1, keepdims=0)
    body.op("Gather", walk.constant(np.asarray(labels, np.int64), np.int64), best, out="Y")
    walk.transformed(body.op("Where", added, total, walk.constant(0.0)), "Z", np.float32)
    return walk.function()


def _binary(node, walk: _Walk, total: str, added: str, labels):
    """Two classes, by onnxruntime's binary rules. With two base values: where class 1 is scored,
    s1 = b1 + s0 and s0 = -s1, else each class adds its base. With fewer, a row whose class 1 no
    tree scores keeps one score s (class 0's, plus its base value if one is given), and Z is
    [1 - s, s] (weights on one class, all positive), s and 0 (weights on both classes and one base
    value: onnxruntime leaves the second score unwritten), or [-s, s] (under LOGISTIC,
    [logistic(-s), logistic(s)]). When the weights are on one class id (a gradient-boosted binary
    classifier), the label is labels[1] where the positive score passes 0.5 (all weights positive)
    or 0; otherwise onnxruntime returns 1 or 0 itself, whatever the labels."""
    body, forest, base = walk.body, walk.forest, walk.forest.base_values
    one_class = len({int(c) for c in _attr(node, "class_ids")}) == 1
    all_positive = bool((floats(node, "class_weights", dtype=np.float64) >= 0).all())
    s0, s1 = (body.op("Gather", total, walk.constant(j, np.int64), axis=1) for j in (0, 1))
    has0, has1 = (body.op("Gather", added, walk.constant(j, np.int64), axis=1) for j in (0, 1))
    zero = walk.constant(0.0)
    if len(base) == 2:
        scored = body.op("Add", s0, walk.constant(base[1]))
        s0 = body.op("Where", has1, body.op("Neg", scored), body.op("Add", s0, walk.constant(base[0])))
        s1 = body.op("Where", has1, scored, body.op("Add", s1, walk.constant(base[1])))
    elif len(base) == 1:
        s0 = body.op("Add", s0, walk.constant(base[0]))
    positive = body.op("Where", has1, s1, body.op("Where", has0, s0, zero))
    wins = body.op("Greater", positive, walk.constant(0.5 if one_class and all_positive else 0.0))
    win, lose = (labels[1], labels[0]) if one_class else (1, 0)
    body.op("Where", wins, walk.constant([win], np.int64), walk.constant([lose], np.int64), out="Y")
    column = walk.constant([1], np.int64)
    pair = walk.transformed(body.op("Concat", body.op("Unsqueeze", body.op("Where", has0, s0, zero), column),
                                    body.op("Unsqueeze", body.op("Where", has1, s1, zero), column), axis=1), None)
    if len(base) == 2:      # both scores always remain
        walk.cast(pair, np.float32, "Z")
        return walk.function()
    s = body.op("Unsqueeze", s0, column)
    if one_class and all_positive:
        single = body.op("Concat", body.op("Sub", walk.constant([[1.0]]), s), s, axis=1)
    elif not one_class and len(base) == 1:
        single = body.op("Concat", s, body.op("Mul", s, walk.constant([[0.0]])), axis=1)
    elif forest.post_transform == "LOGISTIC":
        single = body.op("Concat", body.op("Sigmoid", body.op("Neg", s)), body.op("Sigmoid", s), axis=1)
    else:
        single = body.op("Concat", body.op("Neg", s), s, axis=1)
    walk.cast(body.op("Where", body.op("Unsqueeze", has1, column), pair, single), np.float32, "Z")
    return walk.function()


register("TreeEnsembleRegressor", domain=ML, kind=OTHER, expansion=_tree_ensemble_regressor)
register("TreeEnsembleClassifier", domain=ML, kind=OTHER, expansion=_tree_ensemble_classifier)
register("TreeEnsemble", domain=ML, kind=OTHER, expansion=_tree_ensemble)
