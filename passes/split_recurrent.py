"""Split a recurrent layer (LSTM, GRU, RNN) too large for one CU into its input projection and its
recurrence, one direction at a time.

A layer's gates at step t are `X_t W^T + H_{t-1} R^T + biases`. The first term does not depend on
the state, so for all steps at once it is one MatMul, `X[seq, batch, input] @ W[d]^T`, an ordinary
contraction that `split_large_ops` then cuts along its output channels like any other. What stays
is the recurrence of one direction: R[d] (gates*hidden x hidden), the biases and peepholes, reading
the projected gates. A bidirectional layer becomes two of each, their outputs joined by Concat
along the direction axis, so each direction is its own CU. The recurrence itself cannot be cut (each
step needs the whole state): when one direction's recurrence alone exceeds `--max-cu-size` (a
hidden-512 LSTM's R and B are 1,052,672 parameters), it is reported in `oversized` with the reason,
and the partitioner gives it a CU of its own over the limit, which the manifest and decompose's
summary name; everything that can be divided still keeps to the limit.

How the recurrence is expressed. Every CU is exported as a cu.onnx that onnx.checker accepts and
that onnxruntime runs for the reference checks, so it must be valid ONNX with known semantics:
- A standard LSTM/GRU/RNN node reading the projected gates with W = the identity would do, but its
  W is a (gates*hidden)^2 constant: 4.2 M parameters for one direction of a hidden-512 LSTM, four
  times the W it replaces, and as many multiply-adds per step in the generated kernel.
- So the recurrence is a Cortex op in the private domain `cortex` (`LSTMRecurrence`,
  `GRURecurrence`, `RNNRecurrence`: the standard op's inputs without W, the same attributes),
  registered in ir/ops/recurrent.py with its loop-nest lowering (the standard lowering with the
  projection read instead of computed). The graph carries a model-local ONNX function for each,
  exported into every cu.onnx: the body builds the identity W from the input's shape at run time
  (EyeLike) and calls the standard op, with the attributes passed by reference. onnx.checker and
  ONNX shape inference read the function; onnxruntime inlines it, so the reference runs the spec's
  own op; Cortex never inlines it (the op has a lowering) and never folds it (another domain).
A batch-major layer (layout=1) runs time-major between Transposes (onnxruntime runs no batch-major
recurrent layer, and the reference checks run each cu.onnx on it). The input bias Wb stays in B, which the recurrence adds exactly where the standard op does, so B is
passed through unchanged (GRU's candidate bias included, for either linear_before_reset).

Only a layer whose parameters exceed `--max-cu-size` is split; smaller layers, and every model
without one, are left as they were.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, helper

from ir import dtypes
from ir.graph import Graph, Node, Value
from ir.ops.recurrent import TAKES, activation_parameters

DOMAIN = "cortex"
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
PER_DIRECTION_ACTIVATIONS = {"RNN": 1, "GRU": 2, "LSTM": 3}
INPUTS = {"RNN": ["X", "R", "B", "sequence_lens", "initial_h"],
          "GRU": ["X", "R", "B", "sequence_lens", "initial_h"],
          "LSTM": ["X", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]}
OUTPUTS = {"RNN": ["Y", "Y_h"], "GRU": ["Y", "Y_h"], "LSTM": ["Y", "Y_h", "Y_c"]}
ATTRIBUTE_TYPES = {"hidden_size": AttributeProto.INT, "direction": AttributeProto.STRING,
                   "activations": AttributeProto.STRINGS, "activation_alpha": AttributeProto.FLOATS,
                   "activation_beta": AttributeProto.FLOATS, "clip": AttributeProto.FLOAT,
                   "layout": AttributeProto.INT, "linear_before_reset": AttributeProto.INT,
                   "input_forget": AttributeProto.INT}
MIN_OPSET = 9   # EyeLike, which the function bodies use


def recurrence_op(op_type: str) -> str:
    return f"{op_type}Recurrence"


def split_recurrent(graph: Graph, max_params: int, oversized: dict[int, str] | None = None) -> int:
    """Split every recurrent node holding more than `max_params` parameters; returns how many.
    A recurrence that alone holds more goes into `oversized` (id(node) -> why it exceeds the limit)."""
    opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 21))
    replaced: dict[int, list[Node]] = {}
    for node in graph.nodes:
        if node.domain not in ("", "ai.onnx") or node.op_type not in GATES or not _splittable(node, opset):
            continue
        if _params(node.present_inputs) <= max_params:
            continue
        replaced[id(node)] = _split(graph, node, max_params, oversized if oversized is not None else {})
    if not replaced:
        return 0
    graph.nodes = [n for node in graph.nodes for n in replaced.get(id(node), [node])]
    for op_type in sorted({node.op_type for node in graph.nodes if node.domain == DOMAIN}):
        _ensure_function(graph, op_type.removesuffix("Recurrence"), opset)
    graph.opset_imports.setdefault(DOMAIN, 1)
    graph.topologically_sort()
    return len(replaced)


def _params(values) -> int:
    return sum(int(v.const.size) for v in {id(v): v for v in values if v is not None and v.is_const}.values())


def _splittable(node: Node, opset: int) -> bool:
    x, w, r = node.inputs[0], node.inputs[1], node.inputs[2]
    optional_consts = [node.inputs[i] for i in (3, 7) if len(node.inputs) > i and node.inputs[i] is not None]
    return (opset >= MIN_OPSET and w.is_const and r.is_const and all(v.is_const for v in optional_consts)
            and x.is_static and len(x.shape) == 3 and not node.attrs.get("input_forget", 0))


def _split(graph: Graph, node: Node, max_params: int, oversized: dict[int, str]) -> list[Node]:
    op = node.op_type
    inputs = list(node.inputs) + [None] * (8 - len(node.inputs))
    x, w, r, bias, lengths, h0, c0, peep = inputs
    direction = node.attrs.get("direction", "forward")
    directions = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    layout = int(node.attrs.get("layout", 0))
    state_axis = 1 if layout else 0          # the direction axis of initial_h/c, Y_h and Y_c
    y_axis = 2 if layout else 1              # and of Y
    new_nodes: list[Node] = []
    if layout:   # the recurrence runs time-major (onnxruntime runs no batch-major layer): X turned once
        x = _transpose(graph, x, [1, 0, 2], new_nodes)
    pieces: list[list[Value]] = []
    for d, way in enumerate(directions):
        name = f"{node.name}_{way}" if len(directions) > 1 else node.name
        weight = np.ascontiguousarray(w.const[d].T)
        weight_value = Value(graph.fresh_name(f"{w.name}_{way}_t"), w.dtype, weight.shape, weight)
        gates = Value(graph.fresh_name(f"{name}_input_gates"), x.dtype, (*x.shape[:2], weight.shape[1]))
        new_nodes.append(Node("MatMul", [x, weight_value], [gates], name=graph.fresh_name(f"{name}_input_projection")))
        states = [_direction_slice(graph, v, d, way, state_axis, new_nodes) for v in (h0, c0)]
        if layout:
            states = [_transpose(graph, v, [1, 0, 2], new_nodes) if v is not None else None for v in states]
        own = [gates, _direction_const(graph, r, d, way), _direction_const(graph, bias, d, way), lengths,
               *states, _direction_const(graph, peep, d, way)][:len(INPUTS[op])]
        step_params = _params(own)
        while own and own[-1] is None:
            own.pop()
        outs = _direction_outputs(graph, node, way, len(directions) > 1, (state_axis, y_axis))
        pieces.append(outs)
        if layout:
            outs = [_time_major(graph, v, i, new_nodes) for i, v in enumerate(outs)]
        attrs, types = _direction_attrs(node, d, len(directions) > 1, way)
        attrs.pop("layout", None)
        types.pop("layout", None)
        recurrence = Node(recurrence_op(op), own, outs, attrs, graph.fresh_name(f"{name}_recurrence"), DOMAIN, types)
        if step_params > max_params:
            oversized[id(recurrence)] = (f"the recurrence of one direction of {node.describe()} needs {step_params:,} "
                                         "parameters and cannot be split (every step reads the whole state)")
        new_nodes.append(recurrence)
    if len(directions) > 1:
        for i, original in enumerate(node.outputs[:len(OUTPUTS[op])]):
            if not original.dtype:
                continue
            axis = y_axis if i == 0 else state_axis
            new_nodes.append(Node("Concat", [p[i] for p in pieces], [original], {"axis": axis},
                                  graph.fresh_name(f"{node.name}_join_{OUTPUTS[op][i]}"),
                                  attr_types={"axis": AttributeProto.INT}))
    return new_nodes


def _transpose(graph: Graph, v: Value, perm: list[int], new_nodes: list[Node]) -> Value:
    out = Value(graph.fresh_name(f"{v.name}_time_major"), v.dtype, tuple(v.shape[p] for p in perm))
    new_nodes.append(Node("Transpose", [v], [out], {"perm": perm}, graph.fresh_name(f"{v.name}_transpose"),
                          attr_types={"perm": AttributeProto.INTS}))
    return out


def _time_major(graph: Graph, piece: Value, i: int, new_nodes: list[Node]) -> Value:
    """The time-major value the recurrence writes for batch-major output `piece` (output `i`),
    with the Transpose that turns it into `piece`."""
    if not piece.dtype:
        return piece
    to_time_major = [1, 2, 0, 3] if i == 0 else [1, 0, 2]     # Y: [batch, seq, dirs, hidden]; states
    to_batch_major = [2, 0, 1, 3] if i == 0 else [1, 0, 2]
    inner = Value(graph.fresh_name(f"{piece.name}_time_major"), piece.dtype,
                  tuple(piece.shape[p] for p in to_time_major))
    new_nodes.append(Node("Transpose", [inner], [piece], {"perm": to_batch_major},
                          graph.fresh_name(f"{piece.name}_transpose"), attr_types={"perm": AttributeProto.INTS}))
    return inner


def _direction_const(graph: Graph, v: Value | None, d: int, way: str) -> Value | None:
    if v is None:
        return None
    part = np.ascontiguousarray(v.const[d:d + 1])
    return Value(graph.fresh_name(f"{v.name}_{way}"), v.dtype, part.shape, part)


def _direction_slice(graph: Graph, v: Value | None, d: int, way: str, axis: int, new_nodes: list[Node]) -> Value | None:
    """Direction `d` of an initial state (a constant slice, or a Gather of the model's tensor)."""
    if v is None:
        return None
    if v.is_const:
        part = np.ascontiguousarray(np.take(v.const, [d], axis=axis))
        return Value(graph.fresh_name(f"{v.name}_{way}"), v.dtype, part.shape, part)
    if v.shape is None or v.shape[axis] == 1:
        return v
    shape = list(v.shape)
    shape[axis] = 1
    index = Value(graph.fresh_name(f"{v.name}_{way}_index"), dtypes.INT64, (1,), np.array([d], np.int64))
    part = Value(graph.fresh_name(f"{v.name}_{way}"), v.dtype, tuple(shape))
    new_nodes.append(Node("Gather", [v, index], [part], {"axis": axis}, graph.fresh_name(f"{v.name}_{way}_gather"),
                          attr_types={"axis": AttributeProto.INT}))
    return part


def _direction_outputs(graph: Graph, node: Node, way: str, joined: bool, axes: tuple[int, int]) -> list[Value]:
    """The recurrence's outputs, all of them (ONNX infers a function call's outputs by position): the
    node's own when there is one direction, else one per direction; those the node does not produce
    stay untyped and unread."""
    state_axis, y_axis = axes
    outs = []
    for i in range(len(OUTPUTS[node.op_type])):
        original = node.outputs[i] if i < len(node.outputs) else None
        if original is not None and not joined:
            outs.append(original)
        elif original is None or not original.dtype:
            outs.append(Value(graph.fresh_name(f"{node.name}_{way}_unused{i}")))
        else:
            shape = list(original.shape) if original.shape is not None else None
            if shape is not None:
                shape[y_axis if i == 0 else state_axis] = 1
            outs.append(Value(graph.fresh_name(f"{original.name}_{way}"), original.dtype,
                              tuple(shape) if shape is not None else None))
    return outs


def _direction_attrs(node: Node, d: int, joined: bool, way: str) -> tuple[dict, dict]:
    attrs, types = dict(node.attrs), dict(node.attr_types)
    if not joined:
        return attrs, types
    attrs["direction"] = way
    types["direction"] = AttributeProto.STRING
    per = PER_DIRECTION_ACTIVATIONS[node.op_type]
    names = attrs.get("activations")
    if not names or len(names) < 2 * per:
        return attrs, types
    # The alphas and betas go to the activations that take them, in order: each direction keeps its own.
    own = list(zip(names, activation_parameters(names, attrs.get("activation_alpha"),
                                                attrs.get("activation_beta"))))[d * per:(d + 1) * per]
    attrs["activations"] = [name for name, _ in own]
    for i, key in enumerate(("activation_alpha", "activation_beta")):
        values = [params[i] for name, params in own if TAKES.get(name, (False, False))[i] and params[i] is not None]
        attrs.pop(key, None)
        if values:
            attrs[key] = values
            types[key] = AttributeProto.FLOATS
    return attrs, types


def _ensure_function(graph: Graph, op: str, opset: int) -> None:
    name = recurrence_op(op)
    if any(f.domain == DOMAIN and f.name == name for f in graph.functions):
        return
    graph.functions.append(recurrence_function(op, opset))


def recurrence_function(op: str, opset: int) -> onnx.FunctionProto:
    """`<op>Recurrence` as ONNX: the standard op over the projected gates with W = the identity,
    built from the gates' width at run time, so the function holds no weights."""
    def const(name, values):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64,
                                                                                 [len(values)], values))
    zero = helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("zero", onnx.TensorProto.INT64, [], [0]))
    body = [
        const("last_axis", [2]), const("dir_and_rows", [0, 1]), const("column", [-1, 1]), zero,
        helper.make_node("Shape", ["X"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "last_axis"], ["width"]),            # dirs*gates*hidden
        helper.make_node("Shape", ["R"], ["r_shape"]),
        helper.make_node("Gather", ["r_shape", "dir_and_rows"], ["w_lead"]),        # [dirs, gates*hidden]
        helper.make_node("Gather", ["X", "zero"], ["x_row0"], axis=0),
        helper.make_node("Gather", ["x_row0", "zero"], ["x_row"], axis=0),          # [width], X's type
        helper.make_node("Reshape", ["x_row", "column"], ["x_col"]),
        helper.make_node("Concat", ["width", "width"], ["square"], axis=0),
        helper.make_node("Expand", ["x_col", "square"], ["x_square"]),
        helper.make_node("EyeLike", ["x_square"], ["eye"]),
        helper.make_node("Concat", ["w_lead", "width"], ["w_shape"], axis=0),
        helper.make_node("Reshape", ["eye", "w_shape"], ["W"]),
    ]
    schema = onnx.defs.get_schema(op, opset)
    call = helper.make_node(op, ["X", "W", *INPUTS[op][1:]], OUTPUTS[op])
    call.attribute.extend(helper.make_attribute_ref(key, ATTRIBUTE_TYPES[key])
                          for key in sorted(schema.attributes) if key in ATTRIBUTE_TYPES)
    body.append(call)
    return helper.make_function(DOMAIN, recurrence_op(op), INPUTS[op], OUTPUTS[op], body,
                                [helper.make_opsetid("", opset)],
                                attributes=[key for key in sorted(schema.attributes) if key in ATTRIBUTE_TYPES])
