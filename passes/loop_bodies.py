"""The types of Loop and Scan body inputs, from the node's own inputs.

ONNX infers a body with the types the node hands it but writes nothing back into the body's
inputs, and a function body (LinearAttention's Scan) often declares none. Shape inference of the
body's values needs them, and the loop-nest lowering needs them static: a body input has the type
of the first iteration's value (the loop-carried state's initial value, one slice of a scan
input); a body that keeps its shapes from one iteration to the next keeps that type throughout.
"""

from __future__ import annotations

from ir import dtypes
from ir.graph import Graph, Value
from ir.ops import ELEMENTWISE, kind_of
from ir.subgraphs import body_input_types, loop_trips


def bind_body_inputs(graph: Graph) -> bool:
    """Give every Loop and Scan body input (at any depth) the type its first iteration sees;
    returns whether any changed. A nested body follows once inference has typed the values of the
    body holding it (the caller alternates the two)."""
    opset = graph.opset_imports.get("", 21)
    changed = False
    for node in graph.walk():
        body = node.attrs.get("body")
        if node.domain or node.op_type not in ("Loop", "Scan") or not isinstance(body, Graph):
            continue
        for inner, (dtype, shape) in zip(body.inputs, body_input_types(node, opset)):
            changed |= _set(inner, dtype, shape)
    return changed


def _set(value: Value, dtype: int, shape) -> bool:
    if value.type_proto is not None or (dtype == dtypes.UNDEFINED and shape is None):
        return False
    new_dtype = dtype or value.dtype
    new_shape = value.shape if shape is None else tuple(shape)
    if (new_dtype, new_shape) == (value.dtype, value.shape):
        return False
    value.dtype, value.shape = new_dtype, new_shape
    return True


def loop_hint(node) -> str:
    """Why a Loop or Scan output has no static shape, for the error naming it."""
    if node.domain or node.op_type not in ("Loop", "Scan"):
        return ""
    body = node.attrs.get("body")
    if node.op_type == "Loop":
        carried, results = body.inputs[2:], body.outputs[1:]
    else:
        carried, results = body.inputs[:len(body.inputs) - int(node.attrs.get("num_scan_inputs", 0))], body.outputs
    for inner, result in zip(carried, results):
        if inner.is_static and result.shape is not None and tuple(result.shape) != tuple(inner.shape):
            return (f"; its body changes the shape of loop-carried {inner.name!r} from {list(inner.shape)} to "
                    f"{list(result.shape)}, and only bodies whose shapes stay the same every iteration compile")
    for v in body.values():
        if v.is_tensor and not v.is_static and not v.is_const:
            return f"; body value {v.name!r} has no static shape ({'unknown rank' if v.shape is None else list(v.shape)})"
    if node.op_type == "Loop" and loop_trips(node).stops_early:
        return ("; its scan outputs' length depends on when the loop stops (the trip count or the condition is "
                "computed at run time) and the model declares none")
    return ""


def lengths_from_readers(graph: Graph) -> bool:
    """A Loop scan output whose length is data-dependent has the static shape a one-input
    elementwise reader declares for its own output (Range's body casts its Loop's result back to
    the model's type, and the model declares that result's length); returns whether any changed."""
    changed = False
    for node in graph.walk():
        source = node.inputs[0] if len(node.present_inputs) == 1 and node.inputs else None
        if (source is None or source.is_static or source.producer is None or source.producer.op_type != "Loop"
                or kind_of(node.op_type, node.domain) != ELEMENTWISE or not node.outputs[0].is_static):
            continue
        shape = tuple(node.outputs[0].shape)
        if source.shape is None or (len(source.shape) == len(shape)
                                    and all(not isinstance(a, int) or a == b for a, b in zip(source.shape, shape))):
            source.shape, changed = shape, True
    return changed
