"""An expansion's body read at the model's opset, when the model imports an older one than the body
is written at (models of 2019-2021 converters import opsets 9 to 12; the bodies are written at 13
or 17, see ir/ops/function_body.py).

A body node whose op has the same schema at both opsets is kept. Most ops that changed between
opsets 9 and 17 changed only the types they accept, which a body's own types keep within; the rest
changed their signature, and each such node is rewritten into the older form, generically where
the change is generic:
- an input that became an attribute (ReduceSum's and Squeeze's axes, Split's split, Clip's min and
  max, Slice's starts/ends/axes, TopK's k, Pad's pads) goes back to its attribute, from the
  constant the body gives it;
- an attribute the older schema lacks may be dropped only when it holds the newer default;
- a few ops are rewritten by a rule of their own: Constant's value_float/value_ints forms (opset
  12), Shape's start and end (15), Softmax's axis semantics (13), LayerNormalization (17),
  LessOrEqual and GreaterOrEqual (12).
A node no rule can write at the model's opset (Range before opset 11, an axis computed at run time)
is one error naming the node being expanded and the op.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import AttributeProto, helper, numpy_helper

from ir.errors import UnsupportedError

DEFAULT_DOMAINS = ("", "ai.onnx")
# Inputs that older opsets spell as an attribute of another name (TopK's K, Pad's constant_value).
ATTRIBUTE_NAMES = {"K": "k", "constant_value": "value"}


def body_opset(function: onnx.FunctionProto) -> int | None:
    return next((e.version for e in function.opset_import if e.domain in DEFAULT_DOMAINS), None)


def read_at_opset(function: onnx.FunctionProto, opset: int, describe: str) -> onnx.FunctionProto:
    """`function` with its default-domain ops written at `opset` (its imports say so); `describe`
    names the node being expanded in errors."""
    written = body_opset(function)
    if written is not None and opset < written:
        reader = _Reader(written, opset, describe)
        nodes = reader.rewrite(list(function.node))
        del function.node[:]
        function.node.extend(nodes)
    for entry in function.opset_import:
        if entry.domain in DEFAULT_DOMAINS:
            entry.version = opset
    return function


def since(op_type: str, opset: int) -> int | None:
    """The version of `op_type`'s schema in force at `opset`; None when it has none yet."""
    try:
        return onnx.defs.get_schema(op_type, opset).since_version
    except onnx.defs.SchemaError:
        return None


class _Reader:
    def __init__(self, written: int, opset: int, describe: str):
        self.written, self.opset, self.describe = written, opset, describe
        self.constants: dict[str, np.ndarray] = {}
        self._names = 0

    def rewrite(self, pending: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
        done: list[onnx.NodeProto] = []
        while pending:
            proto = pending.pop(0)
            for attribute in proto.attribute:
                if attribute.type == AttributeProto.GRAPH:     # an If's or Loop's body, in its scope
                    nodes = self.rewrite(list(attribute.g.node))
                    del attribute.g.node[:]
                    attribute.g.node.extend(nodes)
            if proto.domain not in DEFAULT_DOMAINS or since(proto.op_type, self.opset) == since(proto.op_type, self.written):
                self._keep(proto, done)
                continue
            rule = RULES.get(proto.op_type)
            replaced = rule(self, proto) if rule is not None else None
            if replaced is not None:
                pending[:0] = replaced      # read again: a rule writes its nodes in the newer form
                continue
            if since(proto.op_type, self.opset) is None:
                first = next(v for v in range(self.opset + 1, self.written + 1) if since(proto.op_type, v) is not None)
                self.fail(proto, f"which the default domain defines from opset {first} on")
            self._keep(self._older_signature(proto), done)
        return done

    def fail(self, proto: onnx.NodeProto, why: str):
        raise UnsupportedError(f"{self.describe}: its expansion uses {proto.op_type}, {why}; the model imports "
                               f"opset {self.opset} of the default domain")

    def constant(self, proto: onnx.NodeProto, name: str, what: str) -> np.ndarray:
        if name not in self.constants:
            self.fail(proto, f"whose {what} is computed at run time and opset {self.opset} takes it as an attribute")
        return self.constants[name]

    def fresh(self, hint: str) -> str:
        self._names += 1
        return f"opset{self.opset}_{hint}_{self._names}"

    def _keep(self, proto: onnx.NodeProto, done: list[onnx.NodeProto]) -> None:
        if proto.op_type == "Constant" and proto.domain in DEFAULT_DOMAINS:
            value = _constant_value(proto)
            if value is not None:
                self.constants[proto.output[0]] = value
        done.append(proto)

    def _older_signature(self, proto: onnx.NodeProto) -> onnx.NodeProto:
        """The node at the model's opset: inputs that are attributes there moved back to them, an
        attribute it lacks dropped when it holds the newer default."""
        old = onnx.defs.get_schema(proto.op_type, self.opset)
        new = onnx.defs.get_schema(proto.op_type, self.written)
        old_inputs = [p.name for p in old.inputs]
        inputs, attributes = [], []
        for j, name in enumerate(proto.input):
            formal = new.inputs[min(j, len(new.inputs) - 1)].name
            attribute = ATTRIBUTE_NAMES.get(formal, formal)
            if formal in old_inputs or (j < len(old_inputs) and formal not in old.attributes):
                inputs.append(name)
            elif not name:
                continue
            elif attribute in old.attributes:
                attributes.append(_as_attribute(attribute, old.attributes[attribute].type,
                                                self.constant(proto, name, f"input {formal!r}")))
            else:
                self.fail(proto, f"with input {formal!r}, which opset {self.opset} does not take")
        while inputs and not inputs[-1]:
            inputs.pop()
        if len(inputs) < old.min_input:     # an input optional only later (Gemm's C before opset 11)
            self.fail(proto, f"without input {old.inputs[len(inputs)].name!r}, which opset {self.opset} requires")
        for attribute in proto.attribute:
            if attribute.name in old.attributes:
                attributes.append(attribute)
            elif not _is_default(new, attribute):
                self.fail(proto, f"with attribute {attribute.name!r}, which opset {self.opset} does not take")
        node = helper.make_node(proto.op_type, inputs, list(proto.output), name=proto.name)
        node.attribute.extend(attributes)
        return node


def _constant_value(proto: onnx.NodeProto) -> np.ndarray | None:
    for attribute in proto.attribute:
        if attribute.name == "value":
            return numpy_helper.to_array(attribute.t)
        if attribute.name in ("value_float", "value_floats", "value_int", "value_ints"):
            return np.asarray(helper.get_attribute_value(attribute),
                              np.float32 if "float" in attribute.name else np.int64)
    return None


def _as_attribute(name: str, kind, value: np.ndarray) -> AttributeProto:
    if kind == AttributeProto.INTS:
        return helper.make_attribute(name, [int(v) for v in np.asarray(value).reshape(-1)])
    if kind == AttributeProto.INT:
        return helper.make_attribute(name, int(np.asarray(value).reshape(-1)[0]))
    return helper.make_attribute(name, float(np.asarray(value).reshape(-1)[0]))


def _is_default(schema, attribute: AttributeProto) -> bool:
    formal = schema.attributes.get(attribute.name)
    return formal is not None and formal.default_value.name != "" and \
        helper.get_attribute_value(formal.default_value) == helper.get_attribute_value(attribute)


# -- rules for ops whose change is not an input moved to an attribute ---------------------------
def _constant(reader: _Reader, proto: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """value_float, value_ints... (opset 12) as the `value` tensor every opset reads."""
    if any(a.name == "value" for a in proto.attribute):
        return None
    value = _constant_value(proto)
    if value is None:
        reader.fail(proto, "in a form older opsets do not read")
    return [helper.make_node("Constant", [], list(proto.output), value=numpy_helper.from_array(value))]


def _shape(reader: _Reader, proto: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Shape's start and end (opset 15) as a Slice of the whole shape."""
    bounds = {a.name: a.i for a in proto.attribute}
    if not bounds:
        return None
    whole = reader.fresh("shape")
    start = reader.fresh("start")
    end = reader.fresh("end")
    return [helper.make_node("Shape", list(proto.input), [whole]),
            helper.make_node("Constant", [], [start], value_ints=[bounds.get("start", 0)]),
            helper.make_node("Constant", [], [end], value_ints=[bounds.get("end", np.iinfo(np.int64).max)]),
            helper.make_node("Slice", [whole, start, end], list(proto.output))]


def _softmax(reader: _Reader, proto: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Before opset 13 a softmax runs over the input flattened to 2-D at `axis` (default 1): the
    same as opset 13's over one axis only when that axis is the last."""
    axis = next((a.i for a in proto.attribute if a.name == "axis"), -1)
    if axis != -1:
        reader.fail(proto, f"over axis {axis}, which opsets before 13 read as all axes from {axis} on")
    if any(a.name == "axis" for a in proto.attribute):
        return None
    return [helper.make_node(proto.op_type, list(proto.input), list(proto.output), axis=-1)]


def _layer_normalization(reader: _Reader, proto: onnx.NodeProto) -> list[onnx.NodeProto]:
    """LayerNormalization (opset 17) over axes `axis`..-1, as ONNX's definition computes it."""
    attrs = {a.name: helper.get_attribute_value(a) for a in proto.attribute}
    axis, epsilon = int(attrs.get("axis", -1)), float(attrs.get("epsilon", 1e-5))
    if axis >= 0:
        reader.fail(proto, f"over axis {axis} counted from the front, which needs the input's rank")
    x, scale, bias = (list(proto.input) + ["", ""])[:3]
    outputs = list(proto.output) + ["", ""]
    y, mean, inv = outputs[0], outputs[1] or reader.fresh("mean"), outputs[2] or reader.fresh("inv_std")
    names = {k: reader.fresh(k) for k in ("centred", "square", "variance", "epsilon", "shifted", "root", "normed")}
    axes = list(range(axis, 0))
    nodes = [helper.make_node("ReduceMean", [x], [mean], axes=axes),
             helper.make_node("Sub", [x, mean], [names["centred"]]),
             helper.make_node("Mul", [names["centred"], names["centred"]], [names["square"]]),
             helper.make_node("ReduceMean", [names["square"]], [names["variance"]], axes=axes),
             helper.make_node("Constant", [], [names["epsilon"]], value=numpy_helper.from_array(np.float32(epsilon))),
             helper.make_node("Add", [names["variance"], names["epsilon"]], [names["shifted"]]),
             helper.make_node("Sqrt", [names["shifted"]], [names["root"]]),
             helper.make_node("Reciprocal", [names["root"]], [inv]),
             helper.make_node("Mul", [names["centred"], inv], [names["normed"]])]
    scaled = y if not bias else reader.fresh("scaled")
    nodes.append(helper.make_node("Mul", [names["normed"], scale], [scaled]))
    if bias:
        nodes.append(helper.make_node("Add", [scaled, bias], [y]))
    return nodes


def _negated(opposite: str) -> Callable:
    """LessOrEqual and GreaterOrEqual (opset 12) as the negated opposite comparison: the bodies
    compare integers (positions, lengths), where the two agree (floats differ on NaN only)."""
    def rule(reader: _Reader, proto: onnx.NodeProto) -> list[onnx.NodeProto]:
        flipped = reader.fresh(opposite.lower())
        return [helper.make_node(opposite, list(proto.input), [flipped]),
                helper.make_node("Not", [flipped], list(proto.output))]
    return rule


RULES: dict[str, Callable] = {
    "Constant": _constant,
    "Shape": _shape,
    "Softmax": _softmax,
    "LogSoftmax": _softmax,
    "Hardmax": _softmax,
    "LayerNormalization": _layer_normalization,
    "LessOrEqual": _negated("Greater"),
    "GreaterOrEqual": _negated("Less"),
}
