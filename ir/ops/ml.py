"""ai.onnx.ml ops (the classical-ML operator set) that are plain tensor arithmetic, what skl2onnx
writes around a model: lowered (Binarizer, ArrayFeatureExtractor), or expanded into standard ops
with onnxruntime's conventions (Scaler, Normalizer, Imputer, OneHotEncoder, LabelEncoder on
numbers, LinearRegressor, LinearClassifier, SVMRegressor, SVMClassifier). The tree ensembles are
in `ml_trees.py`."""

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ir.errors import NeedsShapes, NotExpanded, UnsupportedError
from ir.loops.expr import cast, gt, lt, select
from ir.ops.function_body import Body
from ir.ops.registry import ELEMENTWISE, LAYOUT, OTHER, lowering, register

ML = "ai.onnx.ml"

register("Binarizer", domain=ML, kind=ELEMENTWISE)
register("ArrayFeatureExtractor", domain=ML, kind=LAYOUT)


@lowering("loops", "Binarizer", domain=ML)
def _binarizer(b, node):
    threshold = float(node.attrs.get("threshold", 0.0))
    b.elementwise(node, lambda x: cast(gt(x, threshold), x.type))


@lowering("loops", "ArrayFeatureExtractor", domain=ML)
def _array_feature_extractor(b, node):
    """Elements of the last axis picked by a flat list of indices (a run-time input); a 1-D input
    gives one row, as onnxruntime does. A negative index counts from the end."""
    x, indices, y = b.input(node, 0), b.input(node, 1), b.output(node)
    last = x.shape[-1]
    outer = int(np.prod(x.shape[:-1], dtype=np.int64))
    picked = indices.numel
    xv, yv = x.view((outer, last)), y.view((outer, picked))
    with b.loop(outer, "o") as o, b.loop(picked, "k") as k:
        at = cast(indices.at(k), "i32")
        at = select(lt(at, 0), at + last, at)
        b.store(yv, (o, k), xv[o, at])


# -- preprocessing and linear models, expanded -------------------------------------------------
def text(value) -> str:
    """A string attribute (onnx hands some back as bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def floats(node, name: str, default=None, dtype=np.float32) -> np.ndarray | None:
    """A float-list attribute as a flat array, or its `name`_as_tensor form (ml opset 3's doubles);
    `default` when neither is given."""
    value = node.attrs.get(name + "_as_tensor")
    value = node.attrs.get(name) if value is None else value
    if value is None:
        return None if default is None else np.asarray(default, dtype)
    if isinstance(value, onnx.TensorProto):
        value = numpy_helper.to_array(value)
    return np.asarray(value, dtype).reshape(-1)


def _post_transform(node) -> str:
    return text(node.attrs.get("post_transform", "NONE"))


def _as_float(body: Body, x: str = "X") -> str:
    """X as float32, the type these ops compute and return in onnxruntime."""
    return body.op("Cast", x, to=TensorProto.FLOAT)


def _scaler(node):
    """Y = (X - offset) * scale, per feature or for all (one value)."""
    body = Body(node, ("X",))
    offset, scale = floats(node, "offset", [0.0]), floats(node, "scale", [1.0])
    body.op("Mul", body.op("Sub", _as_float(body), body.constant(offset)), body.constant(scale), out="Y")
    return body.function(("Y",))


def _normalizer(node):
    """Each row divided by its MAX (the largest value, not magnitude), L1 or L2 norm; a row whose
    norm is 0 stays 0, as onnxruntime gives it."""
    body = Body(node, ("X",))
    norm = text(node.attrs.get("norm", "MAX"))
    x, last = _as_float(body), body.constant([-1], np.int64)
    if norm == "MAX":
        # ReduceMax's axes moved into an input at opset 18: the largest value is TopK's first.
        size = body.constant([1], np.int64)
        divisor = body.op("TopK", x, size, outputs=2, axis=-1)[0]
    elif norm == "L1":
        divisor = body.op("ReduceSum", body.op("Abs", x), last, keepdims=1)
    elif norm == "L2":
        divisor = body.op("Sqrt", body.op("ReduceSum", body.op("Mul", x, x), last, keepdims=1))
    else:
        raise UnsupportedError(f"{node.describe()}: Normalizer norm {norm!r} is not MAX, L1 or L2")
    zero = body.constant(0.0)
    is_zero = body.op("Equal", divisor, zero)
    safe = body.op("Where", is_zero, body.constant(1.0), divisor)
    body.op("Where", is_zero, zero, body.op("Div", x, safe), out="Y")
    return body.function(("Y",))


def _imputer(node):
    """The replaced value (NaN by default in skl2onnx; a NaN matches NaN) becomes the imputed one,
    per feature or for all."""
    body = Body(node, ("X",))
    if node.attrs.get("imputed_value_int64s") is not None:
        imputed = np.asarray(node.attrs["imputed_value_int64s"], np.int64)
        replaced = body.constant(int(node.attrs.get("replaced_value_int64", 0)), np.int64)
        hit = body.op("Equal", "X", replaced)
        body.op("Where", hit, body.constant(imputed, np.int64), "X", out="Y")
        return body.function(("Y",))
    imputed = floats(node, "imputed_value_floats")
    if imputed is None:
        raise UnsupportedError(f"{node.describe()}: Imputer needs imputed_value_floats or imputed_value_int64s")
    replaced = float(node.attrs.get("replaced_value_float", 0.0))
    x = _as_float(body)
    hit = body.op("IsNaN", x) if np.isnan(replaced) else body.op("Equal", x, body.constant(replaced))
    body.op("Where", hit, body.constant(imputed), x, out="Y")
    return body.function(("Y",))


def _one_hot_encoder(node):
    """Y[..., k] = 1 where X equals category k (integer categories; a value in none of them gives a
    row of zeros)."""
    cats = node.attrs.get("cats_int64s")
    if cats is None:
        raise NotExpanded(f"{node.describe()}: OneHotEncoder with string categories is not supported "
                          "(Cortex has no string tensors)")
    if not int(node.attrs.get("zeros", 1)):
        raise NotExpanded(f"{node.describe()}: OneHotEncoder with zeros=0 (an error on unknown categories) "
                          "is not supported")
    body = Body(node, ("X",))
    x = body.op("Unsqueeze", _as_float(body), body.constant([-1], np.int64))
    body.op("Cast", body.op("Equal", x, body.constant(np.asarray(cats, np.float32))), to=TensorProto.FLOAT, out="Y")
    return body.function(("Y",))


def _label_encoder_table(node, side: str) -> np.ndarray | None:
    """The keys or values of a LabelEncoder (2: per-type lists; 4: a tensor), None when strings."""
    tensor = node.attrs.get(f"{side}_tensor")
    if tensor is not None:
        found = numpy_helper.to_array(tensor) if not isinstance(tensor, np.ndarray) else tensor
        return None if found.dtype.kind in "OSU" else found.reshape(-1)
    for suffix, dtype in (("int64s", np.int64), ("floats", np.float32)):
        values = node.attrs.get(f"{side}_{suffix}")
        if values is not None:
            return np.asarray(values, dtype)
    return None


def _label_encoder(node):
    """Each element mapped through keys -> values, the default where no key matches (numbers only)."""
    keys, values = _label_encoder_table(node, "keys"), _label_encoder_table(node, "values")
    if keys is None or values is None:
        raise NotExpanded(f"{node.describe()}: LabelEncoder with string keys or values is not supported "
                          "(Cortex has no string tensors)")
    default = node.attrs.get("default_tensor")
    if default is not None:
        default = (numpy_helper.to_array(default) if not isinstance(default, np.ndarray) else default).reshape(-1)[0]
    elif values.dtype == np.int64:
        default = node.attrs.get("default_int64", -1)
    else:
        default = node.attrs.get("default_float", -0.0)
    body = Body(node, ("X",))
    hits = body.op("Equal", body.op("Unsqueeze", "X", body.constant([-1], np.int64)), body.constant(keys, keys.dtype))
    counted = body.op("Cast", hits, to=TensorProto.INT32)
    found = body.op("Greater", body.op("ReduceSum", counted, body.constant([-1], np.int64), keepdims=0),
                    body.constant(0, np.int32))
    mapped = body.op("Gather", body.constant(values, values.dtype), body.op("ArgMax", counted, axis=-1, keepdims=0))
    body.op("Where", found, mapped, body.constant(default, values.dtype), out="Y")
    return body.function(("Y",))


def _linear_scores(node, body: Body, outputs: int) -> str:
    """X @ coefficients^T + intercepts: [rows, outputs]."""
    coefficients = floats(node, "coefficients")
    if coefficients is None or coefficients.size % outputs:
        raise UnsupportedError(f"{node.describe()}: coefficients do not hold {outputs} rows")
    weights = coefficients.reshape(outputs, -1).T
    intercepts = floats(node, "intercepts", np.zeros(outputs))
    return body.op("Add", body.op("MatMul", _as_float(body), body.constant(weights)), body.constant(intercepts))


def _linear_regressor(node):
    if _post_transform(node) != "NONE":
        raise NotExpanded(f"{node.describe()}: LinearRegressor post_transform {_post_transform(node)} is not "
                          "supported")
    body = Body(node, ("X",))
    body.op("Identity", _linear_scores(node, body, int(node.attrs.get("targets", 1))), out="Y")
    return body.function(("Y",))


def _linear_classifier(node):
    """Y (labels) and Z (scores) as onnxruntime gives them: with one row of coefficients and two
    labels, s = x.w + b, Y = labels[s > 0], Z = [1 - s, s], or [1 - logistic(s), logistic(s)]
    under LOGISTIC (no other transform applies); otherwise Z the scores (their LOGISTIC or SOFTMAX)
    and Y the label of the first highest score."""
    labels = node.attrs.get("classlabels_ints")
    if labels is None:
        raise NotExpanded(f"{node.describe()}: LinearClassifier with string class labels is not supported "
                          "(Cortex has no string tensors)")
    labels, post = np.asarray(labels, np.int64), _post_transform(node)
    x = node.inputs[0]
    if x is None or not x.shape or x.shape[-1] is None or not isinstance(x.shape[-1], int):
        raise NeedsShapes(f"{node.describe()}: the number of features (X's last dim) is not known yet")
    rows = floats(node, "coefficients").size // max(1, x.shape[-1])
    if post not in ("NONE", "LOGISTIC", "SOFTMAX"):
        raise NotExpanded(f"{node.describe()}: LinearClassifier post_transform {post} is not supported")
    body = Body(node, ("X",))
    scores = _linear_scores(node, body, rows)
    if rows == 1 and len(labels) == 2:
        s = body.op("Sigmoid", scores) if post == "LOGISTIC" else scores
        body.op("Concat", body.op("Sub", body.constant([[1.0]]), s), s, axis=1, out="Z")
        wins = body.op("Squeeze", body.op("Greater", scores, body.constant(0.0)), body.constant([1], np.int64))
        body.op("Where", wins, body.constant(labels[1:], np.int64), body.constant(labels[:1], np.int64), out="Y")
        return body.function(("Y", "Z"))
    if rows != len(labels):
        raise UnsupportedError(f"{node.describe()}: {rows} rows of coefficients for {len(labels)} class labels")
    body.op({"NONE": "Identity", "LOGISTIC": "Sigmoid", "SOFTMAX": "Softmax"}[post], scores, out="Z",
            **({"axis": -1} if post == "SOFTMAX" else {}))
    body.op("Gather", body.constant(labels, np.int64), body.op("ArgMax", scores, axis=1, keepdims=0), out="Y")
    return body.function(("Y", "Z"))


def _svm_kernel(node, body: Body, support_vectors: np.ndarray) -> str:
    """K [rows, support vectors] of X against the support vectors, as onnxruntime's kernels compute
    it: LINEAR x.v, POLY (gamma x.v + coef0)^degree, SIGMOID tanh(gamma x.v + coef0), RBF
    exp(-gamma |x - v|^2) (as |x|^2 - 2 x.v + |v|^2: one product instead of a difference per pair)."""
    kind = text(node.attrs.get("kernel_type", "LINEAR"))
    params = floats(node, "kernel_params", [0.0, 0.0, 0.0])
    gamma, coef0, degree = (float(params[i]) if i < len(params) else 0.0 for i in range(3))
    x = _as_float(body)
    dot = body.op("MatMul", x, body.constant(support_vectors.T))
    if kind == "LINEAR":
        return dot
    if kind in ("POLY", "SIGMOID"):
        affine = body.op("Add", body.op("Mul", dot, body.constant(gamma)), body.constant(coef0))
        return body.op("Pow", affine, body.constant(degree)) if kind == "POLY" else body.op("Tanh", affine)
    if kind == "RBF":
        x_norms = body.op("ReduceSum", body.op("Mul", x, x), body.constant([-1], np.int64), keepdims=1)
        v_norms = body.constant((support_vectors.astype(np.float64) ** 2).sum(1).astype(np.float32))
        squared = body.op("Add", body.op("Sub", x_norms, body.op("Mul", dot, body.constant(2.0))), v_norms)
        squared = body.op("Max", squared, body.constant(0.0))
        return body.op("Exp", body.op("Mul", squared, body.constant(-gamma)))
    raise NotExpanded(f"{node.describe()}: SVM kernel_type {kind!r} is not LINEAR, POLY, RBF or SIGMOID")


def _support_vectors(node, count: int) -> np.ndarray:
    values = floats(node, "support_vectors")
    if values is None or count == 0 or values.size % count:
        raise UnsupportedError(f"{node.describe()}: support_vectors do not hold {count} vectors")
    return values.reshape(count, -1)


def _svm_regressor(node):
    """Y = sum_i coefficient_i K(x, v_i) + rho ([rows, 1]); with one_class, 1 where that is
    positive, else -1; without support vectors, a linear model x.coefficients + rho."""
    if _post_transform(node) != "NONE":
        raise NotExpanded(f"{node.describe()}: SVMRegressor post_transform {_post_transform(node)} is not "
                          "supported")
    body = Body(node, ("X",))
    coefficients, rho = floats(node, "coefficients"), float(floats(node, "rho", [0.0])[0])
    supports = int(node.attrs.get("n_supports", 0))
    if supports:
        terms = _svm_kernel(node, body, _support_vectors(node, supports))
    else:
        terms = _as_float(body)
    score = body.op("Add", body.op("MatMul", terms, body.constant(coefficients.reshape(-1, 1))), body.constant(rho))
    if int(node.attrs.get("one_class", 0)):
        body.op("Where", body.op("Greater", score, body.constant(0.0)), body.constant(1.0), body.constant(-1.0),
                out="Y")
    else:
        body.op("Identity", score, out="Y")
    return body.function(("Y",))


def _svm_classifier(node):
    """libsvm's one-against-one SVC as onnxruntime runs it: the decision value of each class pair
    (i, j), d = sum over i's support vectors of coefficients[j-1] K + sum over j's of coefficients[i]
    K + rho; with two classes Z = [-d, d] and Y = labels[0] where d > 0, else labels[1]; with more,
    Z the decision values and Y the label with most votes (i's where d > 0; the first on a tie)."""
    labels = node.attrs.get("classlabels_ints")
    if labels is None:
        raise NotExpanded(f"{node.describe()}: SVMClassifier with string class labels is not supported "
                          "(Cortex has no string tensors)")
    if node.attrs.get("prob_a") is not None or _post_transform(node) != "NONE":
        raise NotExpanded(f"{node.describe()}: SVMClassifier with probabilities (prob_a) or a post_transform "
                          "is not supported")
    per_class = node.attrs.get("vectors_per_class")
    if per_class is None:
        raise NotExpanded(f"{node.describe()}: SVMClassifier without support vectors is not supported")
    labels, per_class = np.asarray(labels, np.int64), [int(c) for c in per_class]
    classes, vectors = len(labels), sum(per_class)
    coefficients, rho = floats(node, "coefficients").reshape(classes - 1, vectors), floats(node, "rho")
    starts = np.concatenate([[0], np.cumsum(per_class)[:-1]]).astype(int)
    pairs = [(i, j) for i in range(classes) for j in range(i + 1, classes)]
    weights = np.zeros((vectors, len(pairs)), np.float32)
    for k, (i, j) in enumerate(pairs):
        mine, theirs = slice(starts[i], starts[i] + per_class[i]), slice(starts[j], starts[j] + per_class[j])
        weights[mine, k] = coefficients[j - 1, mine]
        weights[theirs, k] = coefficients[i, theirs]
    body = Body(node, ("X",))
    kernel = _svm_kernel(node, body, _support_vectors(node, vectors))
    decision = body.op("Add", body.op("MatMul", kernel, body.constant(weights)), body.constant(rho[:len(pairs)]))
    if classes == 2:
        body.op("Concat", body.op("Neg", decision), decision, axis=1, out="Z")
        wins = body.op("Squeeze", body.op("Greater", decision, body.constant(0.0)), body.constant([1], np.int64))
        body.op("Where", wins, body.constant(labels[:1], np.int64), body.constant(labels[1:], np.int64), out="Y")
        return body.function(("Y", "Z"))
    first, second = np.zeros((len(pairs), classes), np.float32), np.zeros((len(pairs), classes), np.float32)
    for k, (i, j) in enumerate(pairs):
        first[k, i], second[k, j] = 1.0, 1.0
    for_first = body.op("Cast", body.op("Greater", decision, body.constant(0.0)), to=TensorProto.FLOAT)
    for_second = body.op("Sub", body.constant(1.0), for_first)
    votes = body.op("Add", body.op("MatMul", for_first, body.constant(first)),
                    body.op("MatMul", for_second, body.constant(second)))
    body.op("Gather", body.constant(labels, np.int64), body.op("ArgMax", votes, axis=1, keepdims=0), out="Y")
    body.op("Identity", decision, out="Z")
    return body.function(("Y", "Z"))


for _op, _expansion in (("Scaler", _scaler), ("Normalizer", _normalizer), ("Imputer", _imputer),
                        ("OneHotEncoder", _one_hot_encoder), ("LabelEncoder", _label_encoder),
                        ("LinearRegressor", _linear_regressor), ("LinearClassifier", _linear_classifier),
                        ("SVMRegressor", _svm_regressor), ("SVMClassifier", _svm_classifier)):
    register(_op, domain=ML, kind=OTHER, expansion=_expansion)
