"""Run QDQ-format models (onnxruntime's `quantize_static` with `QuantFormat.QDQ`) as integer ops.

A QDQ model is a float model with a DequantizeLinear in front of each quantized input and a
QuantizeLinear after each quantized output; run as written, every MatMul and Conv is a float op
on dequantized copies. This pass does what onnxruntime's QDQ transformers do
(`onnxruntime/core/optimizer/qdq_transformer/selectors_actions/qdq_selectors.cc`, `qdq_actions.cc`):

- DQ(a), DQ(b) -> MatMul -> Q            =>  QLinearMatMul
- DQ(a), DQ(b) -> MatMul (float readers) =>  MatMulInteger -> Cast -> Mul(a_scale * b_scale), which
  is onnxruntime's MatMulIntegerToFloat in standard ops
- DQ(x), DQ(w)[, DQ(bias)] -> Conv -> Q  =>  QLinearConv (the bias requantised to x_scale * w_scale)
- DQ(a), DQ(w)[, DQ(c)] -> Gemm          =>  QLinearMatMul when there is no bias and a Q follows,
  else MatMulInteger [-> Add(int32 bias)] -> Cast -> Mul, the Q (if any) left reading it
- float A, DQ(4- or 8-bit weight in blocks along K, per column or per tensor) -> MatMul  =>
  MatMulNBits, the weight kept narrow (passes/dq_matmul_nbits.py, onnxruntime's
  DQMatMulToMatMulNBits), where the rules above take no integer A

and, as onnxruntime's selectors require: every scale and zero point constant, per tensor for
activations (the weight may be per axis on its output-channel axis), 8-bit types, an int8
activation only with an int8 weight, the Q's type that of the activation, the op's output read by
the Q alone and not a graph output. A Relu between the op and its Q is dropped when the Q's zero
point is its type's minimum (the Q then clamps exactly as the Relu would). Anything else is left
as it is, and the folding after this pass makes float constants of the weights it left.

Before those, an op the registry marks `quantized_exact` (Reshape, Transpose, Concat, MaxPool...)
between a DQ and a Q of one scale and zero point runs on the integers and both go, as onnxruntime's
DropQDQNodes does.

A DequantizeLinear of an activation that other nodes read as float stays for them. One of a weight
folds only when every node reading it folds: otherwise the weight would be held twice (int8 and
float), which onnxruntime's weight selectors refuse too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto

from ir import dtypes
from ir.graph import Graph, Node, Value
from ir.ops import is_quantized_exact
from passes.base import Pass
from passes.dq_matmul_nbits import dq_matmul_to_nbits

EIGHT_BIT = (TensorProto.INT8, TensorProto.UINT8)


@dataclass
class Dequantized:
    """A DequantizeLinear's input read in the integer domain."""
    node: Node
    data: Value
    scale: np.ndarray           # float32: a scalar, or one value per index of `axis` (or per block of it)
    zero: np.ndarray            # of data's type, the shape of `scale`
    axis: int | None            # None: per tensor

    @property
    def dtype(self) -> int:
        return self.data.dtype

    @property
    def is_weight(self) -> bool:
        return self.data.is_const


@dataclass
class Quantized:
    """The QuantizeLinear that alone reads an op's output (through a redundant Relu, maybe)."""
    nodes: list[Node]           # [Q] or [Relu, Q]
    scale: np.ndarray
    zero: np.ndarray

    @property
    def output(self) -> Value:
        return self.nodes[-1].outputs[0]

    @property
    def dtype(self) -> int:
        return self.output.dtype


@dataclass
class Rewrite:
    """One op's replacement: `new` nodes instead of `old` (the op, its Q and any Relu)."""
    target: Node
    old: list[Node]
    new: list[Node]
    dequantized: list[Dequantized] = field(default_factory=list)


@dataclass
class FoldQDQ(Pass):
    name = "fold-qdq"

    def run(self, graph: Graph) -> Graph:
        _drop_qdq_around_exact_ops(graph)
        users = graph.users()
        outputs = {id(v) for v in graph.outputs}
        rewrites = [r for node in graph.nodes if (r := _rewrite(node, graph, users, outputs)) is not None]
        rewrites = _without_shared_weights(rewrites, users)
        _apply(graph, rewrites)
        return graph


def reads_integer_weights(node: Node) -> bool:
    """Whether this pass may run `node` on a DequantizeLinear's integer input."""
    return not node.domain and (node.op_type in REWRITES or is_quantized_exact(node.op_type))


def _rewrite(node: Node, graph: Graph, users, outputs) -> Rewrite | None:
    if node.domain or node.op_type not in REWRITES:
        return None
    return REWRITES[node.op_type](node, graph, users, outputs)


def _drop_qdq_around_exact_ops(graph: Graph) -> None:
    """DQ -> op -> Q with one scale and zero point, where the op is exact on the integers (the
    registry's `quantized_exact`: Reshape, Transpose, Concat, MaxPool...), becomes the op on the
    integers; a DQ other nodes read stays for them."""
    users = graph.users()
    outputs = {id(v) for v in graph.outputs}
    dropped = set()
    for node in graph.nodes:
        if node.domain or not is_quantized_exact(node.op_type) or len(node.outputs) != 1:
            continue
        data = [(i, _dequantized(v)) for i, v in enumerate(node.inputs) if v is not None and v.dtype == TensorProto.FLOAT]
        q = _quantized(node.outputs[0], users, outputs)
        if not data or q is None or len(q.nodes) != 1 or not float(q.scale) > 0:
            continue
        if not all(d is not None and d.axis is None and d.dtype == q.dtype and d.scale == q.scale
                   and d.zero == q.zero for _, d in data):
            continue
        for i, d in data:
            node.inputs[i] = d.data
        node.outputs = [q.output]
        q.output.producer = node
        dropped.add(id(q.nodes[0]))
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    _remove_unread_dequantize(graph)


# -- reading the pattern ---------------------------------------------------------------------------
def _dequantized(value: Value | None) -> Dequantized | None:
    node = value.producer if value is not None else None
    if node is None or node.op_type != "DequantizeLinear" or node.domain:
        return None
    data, scale, zero = (node.inputs + [None] * 3)[:3]
    if data.dtype not in EIGHT_BIT or data.shape is None or int(node.attrs.get("block_size", 0)):
        return None
    if not scale.is_const or scale.dtype != TensorProto.FLOAT or (zero is not None and not zero.is_const):
        return None
    zero_point = zero.const if zero is not None else np.zeros(scale.const.shape, dtypes.to_numpy(data.dtype))
    if scale.const.size == 1:
        return Dequantized(node, data, scale.const.reshape(()), zero_point.reshape(()), None)
    axis = int(node.attrs.get("axis", 1)) % len(data.shape)
    return Dequantized(node, data, scale.const, zero_point, axis)


def _quantized(value: Value, users, outputs) -> Quantized | None:
    """The Q reading `value` alone, through a Relu the Q makes redundant."""
    chain = []
    while True:
        readers = users.get(value, [])
        if id(value) in outputs or len(readers) != 1 or readers[0].domain:
            return None
        node = readers[0]
        chain.append(node)
        if node.op_type == "QuantizeLinear":
            break
        if node.op_type != "Relu" or len(chain) > 1:
            return None
        value = node.outputs[0]
    q = chain[-1]
    scale, zero = (q.inputs + [None] * 3)[1:3]
    out = q.outputs[0]
    if out.dtype not in EIGHT_BIT or not scale.is_const or scale.dtype != TensorProto.FLOAT or scale.const.size != 1:
        return None
    if zero is not None and (not zero.is_const or zero.const.size != 1):
        return None
    zero_point = (zero.const if zero is not None else np.zeros((), dtypes.to_numpy(out.dtype))).reshape(())
    if len(chain) == 2 and int(zero_point) != np.iinfo(dtypes.to_numpy(out.dtype)).min:
        return None
    return Quantized(chain, scale.const.reshape(()), zero_point)


def _types_allowed(activation: Dequantized, weight: Dequantized) -> bool:
    """onnxruntime's integer kernels take u8 x u8, u8 x s8 and s8 x s8."""
    return activation.dtype == TensorProto.UINT8 or weight.dtype == TensorProto.INT8


def _per_axis_allowed(operand: Dequantized, axis: int) -> bool:
    """Per tensor, or a constant weight quantized along its output channels."""
    return operand.axis is None or (operand.is_weight and operand.axis == axis % len(operand.data.shape))


# -- the rewrites ------------------------------------------------------------------------------------
def _matmul(node: Node, graph: Graph, users, outputs) -> Rewrite | None:
    integer = _integer_matmul(node, graph, users, outputs)
    return integer if integer is not None else _block_quantized_matmul(node, graph)


def _block_quantized_matmul(node: Node, graph: Graph) -> Rewrite | None:
    found = dq_matmul_to_nbits(node, graph)
    if found is None:
        return None
    nbits, dq = found
    data, scale, zero = (dq.inputs + [None] * 3)[:3]
    zero_point = zero.const if zero is not None else np.zeros(scale.const.shape, dtypes.to_numpy(data.dtype))
    weight = Dequantized(dq, data, scale.const, zero_point, 0)
    return Rewrite(node, [node], [nbits], [weight])


def _integer_matmul(node: Node, graph: Graph, users, outputs) -> Rewrite | None:
    a, b = _dequantized(node.inputs[0]), _dequantized(node.inputs[1])
    if a is None or b is None or a.axis is not None or not _types_allowed(a, b):
        return None
    if b.axis is not None and (len(b.data.shape) != 2 or not _per_axis_allowed(b, 1)):
        return None
    q = _quantized(node.outputs[0], users, outputs)
    if q is not None and q.dtype == a.dtype:
        new = Node("QLinearMatMul", [a.data, *_params(graph, a), b.data, *_params(graph, b), *_params(graph, q)],
                   [q.output], name=node.name)
        return Rewrite(node, [node, *q.nodes], [new], [a, b])
    return Rewrite(node, [node], _integer_to_float(graph, node, a, b, b.data, None), [a, b])


def _gemm(node: Node, graph: Graph, users, outputs) -> Rewrite | None:
    a, b = _dequantized(node.inputs[0]), _dequantized(node.inputs[1])
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    trans_b = int(node.attrs.get("transB", 0))
    if a is None or b is None or a.axis is not None or int(node.attrs.get("transA", 0)) or alpha != 1.0:
        return None
    if not _types_allowed(a, b) or not _per_axis_allowed(b, 0 if trans_b else 1) or (trans_b and not b.is_weight):
        return None
    weight = b.data
    if trans_b:
        weight = _constant(graph, b.data.name + "_transposed", np.ascontiguousarray(b.data.const.T))
    n = weight.shape[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    bias = None
    if c is not None:
        if not isinstance(n, int):
            return None
        bias = _requantised_bias(c, beta, a.scale * b.scale, n)
        if bias is None:
            return None
    b_col = Dequantized(b.node, weight, b.scale, b.zero, None if b.axis is None else 1)
    q = _quantized(node.outputs[0], users, outputs)
    used = [a, b] + ([_dequantized(c)] if _dequantized(c) is not None else [])
    if q is not None and q.dtype == a.dtype and bias is None:
        new = Node("QLinearMatMul", [a.data, *_params(graph, a), weight, *_params(graph, b_col), *_params(graph, q)],
                   [q.output], name=node.name)
        return Rewrite(node, [node, *q.nodes], [new], used)
    bias_value = _constant(graph, node.name + "_bias_int32", bias) if bias is not None else None
    return Rewrite(node, [node], _integer_to_float(graph, node, a, b_col, weight, bias_value), used)


def _conv(node: Node, graph: Graph, users, outputs) -> Rewrite | None:
    x, w = _dequantized(node.inputs[0]), _dequantized(node.inputs[1])
    if x is None or w is None or x.axis is not None or not w.is_weight or not _types_allowed(x, w):
        return None
    if not _per_axis_allowed(w, 0):
        return None
    q = _quantized(node.outputs[0], users, outputs)
    if q is None or q.dtype != x.dtype:
        return None
    inputs = [x.data, *_params(graph, x), w.data, *_params(graph, w), *_params(graph, q)]
    used = [x, w]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    if c is not None:
        bias = _requantised_bias(c, 1.0, x.scale * w.scale, w.data.shape[0])
        if bias is None:
            return None
        inputs.append(_constant(graph, node.name + "_bias_int32", bias))
        used += [d] if (d := _dequantized(c)) is not None else []
    new = Node("QLinearConv", inputs, [q.output], dict(node.attrs), node.name, attr_types=dict(node.attr_types))
    return Rewrite(node, [node, *q.nodes], [new], used)


REWRITES = {"MatMul": _matmul, "Gemm": _gemm, "Conv": _conv}


def _integer_to_float(graph: Graph, node: Node, a: Dequantized, b: Dequantized, weight: Value,
                      bias: Value | None) -> list[Node]:
    """int32 products, the int32 bias, then one float multiply by a_scale * b_scale."""
    out = node.outputs[0]
    shape = out.shape
    product = Value(graph.fresh_name(out.name + "_int32"), TensorProto.INT32, shape)
    # Zero zero points (symmetric weights) are left out: the kernel then subtracts nothing.
    zeros = [None if not np.any(d.zero) else _constant(graph, d.node.inputs[1].name + "_zero", d.zero) for d in (a, b)]
    while zeros and zeros[-1] is None:
        zeros.pop()
    nodes = [Node("MatMulInteger", [a.data, weight, *zeros], [product], name=node.name)]
    if bias is not None:
        biased = Value(graph.fresh_name(out.name + "_biased"), TensorProto.INT32, shape)
        nodes.append(Node("Add", [product, bias], [biased], name=graph.fresh_name(node.name + "_bias")))
        product = biased
    as_float = Value(graph.fresh_name(out.name + "_float"), TensorProto.FLOAT, shape)
    nodes.append(Node("Cast", [product], [as_float], {"to": TensorProto.FLOAT}, graph.fresh_name(node.name + "_cast"),
                      attr_types={"to": 2}))
    scale = _constant(graph, out.name + "_scale", (a.scale * b.scale).astype(np.float32))
    nodes.append(Node("Mul", [as_float, scale], [out], name=graph.fresh_name(node.name + "_scale")))
    return nodes


def _requantised_bias(c: Value, beta: float, accumulator_scale: np.ndarray, n: int) -> np.ndarray | None:
    """A constant bias (float, or DequantizeLinear of int32) in the accumulator's scale, as int32 [n].
    onnxruntime adds the quantizer's int32 bias as it is; its scale is x_scale * w_scale, so this
    gives the same integers, and a bias in any other scale is rounded into that one."""
    d = _dequantized_bias(c)
    if d is None:
        return None
    values = beta * d
    if values.size not in (1, n) or values.ndim > 2 or (values.ndim == 2 and values.shape[0] != 1):
        return None
    scale = np.broadcast_to(accumulator_scale.astype(np.float64), (n,))
    if np.any(scale <= 0):
        return None
    ints = np.rint(np.broadcast_to(values.reshape(-1), (n,)) / scale)
    info = np.iinfo(np.int32)
    return np.clip(ints, info.min, info.max).astype(np.int32)


def _dequantized_bias(c: Value) -> np.ndarray | None:
    if c.is_const:
        return c.const.astype(np.float64) if c.dtype == TensorProto.FLOAT else None
    node = c.producer
    if node is None or node.op_type != "DequantizeLinear" or node.domain:
        return None
    data, scale, zero = (node.inputs + [None] * 3)[:3]
    if data.dtype != TensorProto.INT32 or not data.is_const or not scale.is_const:
        return None
    if zero is not None and not zero.is_const:
        return None
    z = zero.const.astype(np.float64) if zero is not None else 0.0
    return (data.const.astype(np.float64) - z) * scale.const.astype(np.float64)


def _params(graph: Graph, operand) -> list[Value]:
    """(scale, zero point) as constants: scalars per tensor, 1-D per axis."""
    base = operand.node.inputs[1].name if isinstance(operand, Dequantized) else operand.nodes[-1].inputs[1].name
    return [_constant(graph, base, operand.scale.astype(np.float32)),
            _constant(graph, base + "_zero", operand.zero)]


def _constant(graph: Graph, base: str, array: np.ndarray) -> Value:
    array = np.asarray(array)
    return Value(graph.fresh_name(base), dtypes.from_numpy(array.dtype), tuple(array.shape), array)


# -- applying ---------------------------------------------------------------------------------------
def _without_shared_weights(rewrites: list[Rewrite], users) -> list[Rewrite]:
    """Drop rewrites whose weight's DequantizeLinear another node still reads as float, until none is."""
    while True:
        targets = {id(r.target) for r in rewrites}
        kept = [r for r in rewrites
                if all(not d.is_weight or all(id(u) in targets for u in users.get(d.node.outputs[0], []))
                       for d in r.dequantized)]
        if len(kept) == len(rewrites):
            return kept
        rewrites = kept


def _apply(graph: Graph, rewrites: list[Rewrite]) -> None:
    replaced = {id(r.target): r for r in rewrites}
    removed = {id(n) for r in rewrites for n in r.old}
    nodes = []
    for node in graph.nodes:
        if id(node) in replaced:
            nodes.extend(replaced[id(node)].new)
        elif id(node) not in removed:
            nodes.append(node)
    graph.nodes = nodes
    _remove_unread_dequantize(graph)


def _remove_unread_dequantize(graph: Graph) -> None:
    """The DequantizeLinear nodes the rewrites read past (weights, biases), once nothing reads them."""
    while True:
        read = {id(v) for n in graph.nodes for v in n.present_inputs} | {id(v) for v in graph.outputs}
        kept = [n for n in graph.nodes if n.op_type != "DequantizeLinear" or id(n.outputs[0]) in read]
        if len(kept) == len(graph.nodes):
            return
        graph.nodes = kept
