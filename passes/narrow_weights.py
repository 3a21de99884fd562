"""Store a CU's weights in a reduced precision: the graph of a `compile-<target> --variants` build.

Each float32 constant that an op reads as its weight (the registry's `weight_input`: MatMul's and
Gemm's B, Conv's W, an embedding table of Gather) becomes a low-precision constant and a
conversion back to float32, so the kernels still compute in float32 and the artifact holds the
narrow bytes:
- `fp16` / `bf16`: the weight rounded to float16 / bfloat16 (nearest even), then Cast to float32;
- `int8`: per-output-channel symmetric int8, q = round(w / s) in [-127, 127] with
  s[c] = max|w[c]| / 127 over each output channel c (the registry's `weight_axis`), then
  Cast to float32 and Mul by s (what DequantizeLinear with that axis computes; written as Cast and
  Mul so that it holds at every opset).
Biases, norms' scales and other small constants stay float32: they are a small share of the bytes
and the errors they would add are not worth it. A Gather reads its narrow table first and converts
only the rows it gathered, so a large embedding table is not widened whole on every call.

The conversion runs on every call (it is an ordinary node of the CU); the backends do not yet fold
it at instantiation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ir import dtypes
from ir.graph import Graph, Node, Value
from ir.ops.registry import lookup
from passes.base import Pass

PRECISIONS = ("fp16", "bf16", "int8")
STORED = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16), "int8": np.dtype(np.int8)}
MIN_WEIGHT_ELEMENTS = 64        # smaller weights are not worth a conversion node


def weight_readers(graph: Graph) -> list[tuple[Node, int, int]]:
    """(node, weight input index, output-channel axis of that weight) for each float32 weight."""
    found = []
    for node in graph.nodes:
        op = lookup(node.op_type, node.domain)
        if op is None or op.weight_input is None or op.weight_axis is None:
            continue
        index = op.weight_input
        w = node.inputs[index] if index < len(node.inputs) else None
        if w is None or not w.is_const or w.dtype != dtypes.from_numpy(np.float32) or w.const.size < MIN_WEIGHT_ELEMENTS:
            continue
        if not np.isfinite(w.const).all():     # int8 cannot hold NaN / Inf, and the others would only copy them
            continue
        axis = op.weight_axis(node)
        if axis is None:
            continue
        found.append((node, index, axis % w.const.ndim))
    return found


def quantize_per_channel(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes and the float32 scale per slice along `axis` (shaped to broadcast)."""
    others = tuple(d for d in range(w.ndim) if d != axis)
    peak = np.max(np.abs(w), axis=others, keepdims=True)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return codes, scale


@dataclass
class NarrowWeights(Pass):
    name = "narrow-weights"
    precision: str = "fp16"

    def run(self, graph: Graph) -> Graph:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}")
        stored: dict[tuple[int, int], tuple[Value, Value | None]] = {}
        added: list[Node] = []
        for node, index, axis in weight_readers(graph):
            w = node.inputs[index]
            key = (id(w), axis)
            if key not in stored:
                stored[key] = self._narrow_constant(graph, w, axis)
            narrow, scale = stored[key]
            if node.op_type == "Gather":    # gather the narrow rows, then widen only those
                out = node.outputs[0]
                gathered = Value(graph.fresh_name(f"{out.name}_{self.precision}"), narrow.dtype, out.shape)
                node.inputs[index] = narrow
                node.outputs[0] = gathered
                gathered.producer = node
                # The table's channel axis is its last, which is the gathered rows' last too.
                row_scale = None if scale is None else _constant(graph, f"{w.name}_row_scale", scale.const.reshape(-1))
                added += self._widen(graph, gathered, row_scale, out)
            else:
                wide = Value(graph.fresh_name(f"{w.name}_widened"), w.dtype, w.shape)
                added += self._widen(graph, narrow, scale, wide)
                node.inputs[index] = wide
        graph.nodes += added
        graph.topologically_sort()
        return graph

    def _narrow_constant(self, graph: Graph, w: Value, axis: int) -> tuple[Value, Value | None]:
        if self.precision == "int8":
            codes, scale = quantize_per_channel(w.const, axis)
            return (_constant(graph, f"{w.name}_int8", codes), _constant(graph, f"{w.name}_scale", scale))
        return _constant(graph, f"{w.name}_{self.precision}", w.const.astype(STORED[self.precision])), None

    def _widen(self, graph: Graph, narrow: Value, scale: Value | None, out: Value) -> list[Node]:
        """narrow -> float32 `out` (times the per-channel scale for int8)."""
        float32 = dtypes.from_numpy(np.float32)
        if scale is None:
            return [Node("Cast", [narrow], [out], {"to": float32}, name=graph.fresh_name(f"{out.name}_cast"))]
        widened = Value(graph.fresh_name(f"{out.name}_codes"), float32, out.shape)
        return [Node("Cast", [narrow], [widened], {"to": float32}, name=graph.fresh_name(f"{out.name}_cast")),
                Node("Mul", [widened, scale], [out], name=graph.fresh_name(f"{out.name}_dequantize"))]


def _constant(graph: Graph, base: str, array: np.ndarray) -> Value:
    array = np.ascontiguousarray(array)
    return Value(graph.fresh_name(base), dtypes.from_numpy(array.dtype), tuple(array.shape), const=array)


def narrowed(graph: Graph, precision: str) -> Graph | None:
    """A copy of `graph` with its weights stored in `precision`; None when it has no weights."""
    if not weight_readers(graph):
        return None
    return NarrowWeights(precision).run(_copy_graph(graph))


def _copy_graph(graph: Graph) -> Graph:
    """A deep copy that shares the (read-only) constant arrays instead of duplicating them."""
    memo = {id(v.const): v.const for v in graph.values() if v.const is not None}
    return copy.deepcopy(graph, memo)
