"""Evaluate nodes whose inputs are all constants, and shape queries on static shapes.

Evaluation goes through onnxruntime (the reference Cortex is measured against), with the ONNX
reference evaluator as a fallback for ops or types onnxruntime rejects in isolation; Cortex keeps no
op library of its own in numpy. Random ops, control flow and non-standard domains are never folded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from ir import dtypes
from ir.graph import Graph, Node, Value
from ir.onnx_export import export_attribute, make_tensor
from ir.ops import lookup
from passes.base import Pass
from passes.fold_qdq import reads_integer_weights

FOLDABLE_DOMAINS = ("", "ai.onnx")


@dataclass
class FoldConstants(Pass):
    name = "fold-constants"
    # Results larger than this stay as ops: folding a huge Expand or Tile would bloat the model.
    max_folded_bytes: int = 1 << 30
    # A DequantizeLinear of a constant that a contraction or an integer-exact op reads stays, so
    # that fold-qdq still sees the integer weight and its scale (folded, it is a float weight and the
    # model can only run as float); the folding after fold-qdq turns the ones it left into float
    # constants. One that only other ops read (a quantized Range step, a LayerNorm scale) folds now,
    # so that the shapes computed from it become static.
    keep_dequantized_weights: bool = False

    def run(self, graph: Graph) -> Graph:
        kept = []
        users = graph.users() if self.keep_dequantized_weights else {}
        for node in graph.nodes:
            results = self._try_fold(node, graph, users)
            if results is None:
                kept.append(node)
                continue
            for out, arr in zip(node.outputs, results):
                out.const = arr
                out.shape = tuple(arr.shape)
                if out.dtype == dtypes.UNDEFINED:
                    out.dtype = dtypes.from_numpy(arr.dtype) if arr.dtype != object else onnx.TensorProto.STRING
                out.producer = None
        graph.nodes = kept
        for node in graph.nodes:
            for sub in node.subgraphs:
                self.run(sub)
        return graph

    def _try_fold(self, node: Node, graph: Graph, users) -> list[np.ndarray] | None:
        if node.domain not in FOLDABLE_DOMAINS or node.subgraphs:
            return None
        if (self.keep_dequantized_weights and node.op_type == "DequantizeLinear"
                and any(reads_integer_weights(r) for r in users.get(node.outputs[0], ()))):
            return None
        entry = lookup(node.op_type, node.domain)
        if entry is not None and not entry.deterministic:
            return None
        if any(not out.is_tensor for out in node.outputs):
            return None
        shape_result = _fold_shape_query(node)
        if shape_result is not None:
            return [shape_result]
        if not node.present_inputs or not all(v.is_const for v in node.present_inputs):
            return None
        if any(v.const.dtype == object for v in node.present_inputs) and node.op_type not in ("Identity",):
            return None  # string ops are rare in constant subgraphs and onnxruntime's are partial
        results = evaluate_node(node, graph.opset_imports)
        if results is None or sum(r.nbytes for r in results) > self.max_folded_bytes:
            return None
        return results


def _fold_shape_query(node: Node) -> np.ndarray | None:
    if node.op_type not in ("Shape", "Size") or not node.inputs or node.inputs[0] is None:
        return None
    x = node.inputs[0]
    if not x.is_static or x.is_bounded:    # a bounded shape is an upper bound, not the value
        return None
    if node.op_type == "Size":
        return np.array(x.numel, dtype=np.int64)
    rank = len(x.shape)
    start = node.attrs.get("start", 0)
    end = node.attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(x.shape[start:end], dtype=np.int64)


def evaluate_node(node: Node, opset_imports: dict[str, int]) -> list[np.ndarray] | None:
    """Run one node on constant inputs; None when neither evaluator can."""
    model = _single_node_model(node, opset_imports)
    results = _run_with_onnxruntime(model)
    if results is None:
        results = _run_with_reference(model)
    return results


def _single_node_model(node: Node, opset_imports: dict[str, int]) -> onnx.ModelProto:
    input_names = []
    initializers = []
    for i, v in enumerate(node.inputs):
        if v is None:
            input_names.append("")
            continue
        name = f"in{i}"
        input_names.append(name)
        t = make_tensor(Value(name, v.dtype, v.shape, v.const))
        initializers.append(t)
    output_names = [f"out{i}" for i in range(len(node.outputs))]
    proto = helper.make_node(node.op_type, input_names, output_names, domain=node.domain or None)
    for key, value in node.attrs.items():
        proto.attribute.append(export_attribute(key, value, node.attr_types.get(key), {}, False))
    outputs = [helper.make_empty_tensor_value_info(n) for n in output_names]
    g = helper.make_graph([proto], "fold", [], outputs, initializers)
    opsets = [helper.make_opsetid(d, v) for d, v in opset_imports.items() if d in FOLDABLE_DOMAINS]
    model = helper.make_model(g, opset_imports=opsets)
    model.ir_version = 10
    return model


def _run_with_onnxruntime(model: onnx.ModelProto) -> list[np.ndarray] | None:
    import onnxruntime as ort
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return [np.asarray(r) for r in session.run(None, {})]
    except Exception:
        return None


def _run_with_reference(model: onnx.ModelProto) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, {})]
    except Exception:
        return None
