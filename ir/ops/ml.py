"""ai.onnx.ml ops that are plain tensor arithmetic (the classical-ML operator set)."""

import numpy as np

from ir.loops.expr import cast, gt, lt, select
from ir.ops.registry import ELEMENTWISE, LAYOUT, lowering, register

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
