"""Weights a GEMM kernel may read narrow: the widening a `--variants` build puts in front of a
MatMul's or Gemm's B (`passes/narrow_weights.py`), recognised so that a target whose kernel reads
bf16, fp16 or int8 panels packs the narrow constant instead of computing the widening on every call.

- bf16: B = Cast(bf16 constant, to=float32). Widening a bfloat16 is exact (its bits are the high
  half of the float32's), so a kernel reading the bf16 bits computes the same products.
- fp16: B = Cast(float16 constant, to=float32), all of its values finite. Every finite float16
  (subnormals included) is a float32, so the widening is exact too; a kernel widens with integer
  ops and one exact multiply (kernels/narrow_panels.py), which would turn Inf and NaN into finite
  values, so a constant holding one (a float32 weight beyond 65504 rounds to Inf) keeps its Cast.
- int8: B = Mul(Cast(int8 constant, to=float32), scale) with one float32 scale per output column
  of the product (per channel along the reader's N). The kernel sums a * q over k and multiplies
  the sum by s[n] once, the same products scaled once instead of each one (float32 rounding aside).

Only a chain read by nothing else (each value one reader, none a graph output) whose last value is
input 1 of a MatMul or a Gemm (alpha 1) is recognised; `narrow_weight_chains` finds them before
the graph is lowered, so that the builder can hold the widening back until the reader has decided.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from ir.graph import Graph, Node, Value

FORMATS = ("bf16", "fp16", "int8")


@dataclass(eq=False)
class NarrowWeight:
    """B as the narrow constant it is widened from: `codes` (bfloat16, float16 or int8, B's shape as the
    graph holds it), `column_scale` (int8: N float32s, one per column of the product, else None),
    and `nodes`, the widening (Cast, Mul), which a kernel reading `codes` makes dead."""
    format: str
    codes: np.ndarray
    column_scale: np.ndarray | None
    nodes: tuple[Node, ...]


def narrow_weight_chains(graph: Graph, readers: dict[int, list[Node]], outputs: set[int]) -> dict[int, NarrowWeight]:
    """id(value) -> its `NarrowWeight`, for each value that is the B of a MatMul or a Gemm and is a
    recognised widening. `readers`: id(value) -> the nodes that read it; `outputs`: the ids of the
    graph's outputs."""

    def sole_reader(value: Value) -> Node | None:
        nodes = readers.get(id(value), [])
        return nodes[0] if len(nodes) == 1 and id(value) not in outputs else None

    found = {}
    for node in graph.nodes:
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        b = node.inputs[1]
        if b is None or b.producer is None or sole_reader(b) is not node or len(b.shape or ()) != 2:
            continue
        if node.op_type == "Gemm" and float(node.attrs.get("alpha", 1.0)) != 1.0:
            continue
        trans_b = node.op_type == "Gemm" and bool(node.attrs.get("transB", 0))
        weight = _recognise(b.producer, trans_b, sole_reader)
        if weight is not None:
            found[id(b)] = weight
    return found


def _recognise(producer: Node, trans_b: bool, sole_reader) -> NarrowWeight | None:
    codes = _widened_constant(producer)
    if codes is not None:
        if codes.dtype.name == "bfloat16":
            return NarrowWeight("bf16", codes, None, (producer,))
        if codes.dtype == np.float16 and np.isfinite(codes).all():
            return NarrowWeight("fp16", codes, None, (producer,))
        return None
    if producer.op_type != "Mul" or len(producer.inputs) != 2:
        return None
    for widened, scale in (producer.inputs, producer.inputs[::-1]):
        if widened is None or widened.producer is None or scale is None or not scale.is_const:
            continue
        cast = widened.producer
        codes = _widened_constant(cast)
        if codes is None or codes.dtype != np.int8 or sole_reader(widened) is not producer:
            continue
        column_scale = _column_scale(np.asarray(scale.const), codes.shape, trans_b)
        if column_scale is not None:
            return NarrowWeight("int8", codes, column_scale, (cast, producer))
    return None


def _widened_constant(node: Node) -> np.ndarray | None:
    """The constant a Cast to float32 widens, when `node` is one."""
    if node.op_type != "Cast" or int(node.attrs.get("to", 0)) != TensorProto.FLOAT or not node.inputs[0].is_const:
        return None
    codes = np.asarray(node.inputs[0].const)
    return codes if codes.ndim == 2 else None


def _column_scale(scale: np.ndarray, shape: tuple[int, int], trans_b: bool) -> np.ndarray | None:
    """`scale` as one float32 per column of the product, when it broadcasts over B (`shape`, [k, n]
    or [n, k] with `trans_b`) as one value per column; else None."""
    if scale.dtype != np.float32 or scale.ndim > 2:
        return None
    n_axis = 0 if trans_b else 1
    expected = (shape[0], 1) if trans_b else (1, shape[1])
    if scale.ndim == 2 and scale.shape != expected:
        return None
    if scale.ndim < 2 and (trans_b or scale.size not in (1, shape[1])):
        return None
    return np.ascontiguousarray(np.broadcast_to(scale.reshape(expected if scale.ndim == 2 else (1, -1)),
                                                shape).take(0, axis=1 - n_axis), dtype=np.float32)
