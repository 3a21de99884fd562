"""Resize and Upsample as separable interpolation.

Every mode ONNX defines (nearest, linear, cubic, with their coordinate transforms, antialiasing
and exclude_outside) is linear in the input and acts on each axis separately. So for each resized
axis the compiler asks the ONNX reference evaluator to resize an identity matrix along that axis,
which yields the exact (output x input) interpolation matrix without a second implementation of
the spec here. Its non-zero entries become small tap tables (index, weight) baked into the module,
and the loop nest sums the taps' products.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ir.errors import UnsupportedError
from ir.loops.expr import cast, unary
from ir.ops.registry import OTHER, lowering, register

register("Resize", "Upsample", kind=OTHER)


def _axis_matrix(node, opset: int, n_in: int, n_out: int, scale: float | None, roi: tuple | None) -> np.ndarray:
    """(n_out x n_in) matrix M with resize(x) = M @ x along one axis, from the reference evaluator."""
    from onnx.reference import ReferenceEvaluator
    attrs = {k: v for k, v in node.attrs.items() if k not in ("axes", "keep_aspect_ratio_policy")}
    inputs = ["x"]
    inits = []
    if node.op_type == "Upsample":
        inits.append(numpy_helper.from_array(np.array([1.0, scale], dtype=np.float32), "scales"))
        inputs.append("scales")
    else:
        roi_values = [0.0, roi[0], 1.0, roi[1]] if roi is not None else []
        inits.append(numpy_helper.from_array(np.array(roi_values, dtype=np.float32), "roi"))
        if scale is not None:
            inits.append(numpy_helper.from_array(np.array([1.0, scale], dtype=np.float32), "scales"))
            inputs += ["roi", "scales"]
        else:
            inits.append(numpy_helper.from_array(np.array([n_in, n_out], dtype=np.int64), "sizes"))
            inputs += ["roi", "", "sizes"]
    model = helper.make_model(
        helper.make_graph([helper.make_node(node.op_type, inputs, ["y"], **attrs)], "axis",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [n_in, n_in])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)], inits),
        opset_imports=[helper.make_opsetid("", opset)])
    (out,) = ReferenceEvaluator(model).run(None, {"x": np.eye(n_in)})
    if out.shape != (n_in, n_out):
        raise UnsupportedError(f"{node.describe()}: cannot reproduce output size {n_out} along an axis "
                               f"(got {out.shape[1]})")
    return out.T


def _taps(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = [np.flatnonzero(r) for r in matrix]
    width = max(1, max(len(r) for r in rows))
    index = np.zeros((len(rows), width), dtype=np.int32)
    weight = np.zeros((len(rows), width), dtype=np.float32)
    for o, cols in enumerate(rows):
        index[o, :len(cols)] = cols
        weight[o, :len(cols)] = matrix[o, cols]
    return index, weight


@lowering("loops", "Resize", "Upsample")
def _resize(b, node):
    x, y = b.input(node, 0), b.output(node)
    rank = len(x.shape)
    opset = int(b.graph.opset_imports.get("", 21))
    if node.attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize" and \
            float(node.attrs.get("extrapolation_value", 0.0)) != 0.0:
        raise UnsupportedError(f"{node.describe()}: tf_crop_and_resize with a non-zero extrapolation_value")
    scales = roi = sizes = None
    if node.op_type == "Upsample":
        scales = node.attrs.get("scales")
        scales = np.asarray(scales if scales is not None else b.const_input(node, 1), dtype=np.float64)
    else:
        roi = b.const_input(node, 1)
        scales = b.const_input(node, 2)
        sizes = b.const_input(node, 3)
        if scales is not None and scales.size == 0:
            scales = None
        if roi is not None and roi.size == 0:
            roi = None
    axes = [int(a) % rank for a in node.attrs.get("axes", range(rank))]
    full_scales = [None] * rank
    full_roi = [None] * rank
    for k, a in enumerate(axes):
        if scales is not None:
            full_scales[a] = float(scales.reshape(-1)[k])
        if roi is not None:
            full_roi[a] = (float(roi.reshape(-1)[k]), float(roi.reshape(-1)[k + len(axes)]))
    policy = node.attrs.get("keep_aspect_ratio_policy", "stretch")
    if sizes is not None and policy != "stretch":
        ratios = [y.shape[a] / x.shape[a] for a in axes]
        common = min(ratios) if policy == "not_larger" else max(ratios)
        for a in axes:
            full_scales[a] = common
    tables = []
    for a in range(rank):
        identity = x.shape[a] == y.shape[a] and full_scales[a] in (None, 1.0) and full_roi[a] in (None, (0.0, 1.0))
        if a not in axes or identity:
            tables.append(None)
            continue
        matrix = _axis_matrix(node, opset, x.shape[a], y.shape[a], full_scales[a], full_roi[a])
        index, weight = _taps(matrix)
        tables.append((b.constant(index, f"{node.name}_index{a}"), b.constant(weight, f"{node.name}_weight{a}"),
                       index.shape[1]))
    t = "f64" if x.compute_type == "f64" else "f32"
    with b.loops(y.shape, "o") as out_idx:
        acc = b.local(t, 0.0, "acc")
        resized = [(a, tab) for a, tab in enumerate(tables) if tab is not None]
        with b.loops([tab[2] for _, tab in resized], "t") as taps:
            src = list(out_idx)
            weight = None
            for (a, (index, w, _)), tap in zip(resized, taps):
                src[a] = index[out_idx[a], tap]
                wa = cast(w[out_idx[a], tap], t)
                weight = wa if weight is None else weight * wa
            value = cast(x[tuple(src)], t)
            b.assign(acc, acc + (value * weight if weight is not None else value))
        result = acc
        if y.compute_type in ("i32", "i64"):
            result = unary("nearest", acc)
        b.store(y, tuple(out_idx), cast(result, y.compute_type))
