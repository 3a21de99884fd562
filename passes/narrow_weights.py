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

The conversion runs on every call (it is an ordinary node of the CU); a kernel that reads the narrow
weight itself (ir/loops/narrow_weights.py) never computes it.

An int8 MatMul or Gemm whose A has more than two rows (a GEMM, where multiplying costs more than
reading the weight; one or two rows run on the GEMV, which streams the weight) multiplies integers
instead: A is quantized at run time per tensor to uint8 as DynamicQuantizeLinear computes it
(a_scale = (max(A, 0) - min(A, 0)) / 255, a_zero = round-half-even(-min(A, 0) / a_scale)), and

    Y = float32(int32 sum_k (qA[i, k] - a_zero) * q[k, j]) * (a_scale * s[j])  [+ bias]

the arithmetic of onnxruntime's DynamicQuantizeMatMul on the int8 codes q with b_scale s (and what
quantize_dynamic writes): DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul, which the
lowering runs as the integer GEMM with a dequantizing epilogue (ir/ops/quantized.py). A Gemm's alpha
is folded into s, its beta into a constant C (a C computed at run time is added when beta is 1,
else the Gemm keeps the weight-only form, as it does with transA). The contract of the int8 variant
is thus: weights per output channel, and for GEMM-shaped products the activations per tensor too.
A 2-D Conv of at least MIN_CONV_TAPS taps per output (`convolves_integers`; no depthwise one)
multiplies integers too, its X quantized per tensor likewise (once for all the Convs that read it):
Y = float32(ConvInteger(qX, q, x_zero)) * (x_scale * s[c]) [+ bias[c]], scale and bias [1, C, 1, 1],
on the integer Conv kernel (whose padding holds x_zero, so a padded tap adds 0, as the float Conv's
zero padding does), the Cast / Mul / Add as elementwise kernels after it.
The wasm integer GEMM holds B as int16 k-pair panels, so such a product's module stores two bytes
per weight, not one (the GEMV's int8 panels and a Gather's table keep one).
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
# Products of at most this many rows run on the wasm GEMV (backends/wasm/kernels/gemv.py MAX_ROWS),
# which reads int8 panels at the memory's speed: quantizing A would only add work and error there.
GEMV_ROWS = 2
# A Conv with fewer taps per output (C / groups x KH x KW) keeps the weight-only form: its integer sums
# save less than the passes around them cost (quantizing X, packing it into int16 panels, the Cast /
# Mul / Add kernels after). wasm simd, one Conv + Relu: 3x3 depthwise (9 taps) over 64 channels at
# 56x56 0.8 ms against the float direct kernel's 0.2; 3 -> 64 3x3 stride 2 at 224x224 (27 taps)
# 2.0 ms against 1.7; 16 -> 64 1x1 at 55x55 (16) 0.26 against 0.28; 128 -> 256 3x3 in 64 groups
# (18) 0.65 against 0.71; 32 -> 128 1x1 at 27x27 (32) 0.16 against 0.22; 3x3 over 16 channels
# (144) 1.1 against 1.9.
MIN_CONV_TAPS = 32


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
    # int8 GEMM-shaped products as DynamicQuantizeLinear -> MatMulInteger (False: every product
    # keeps the weight-only form, Mul(Cast(int8 codes), scale), the narrow-panel kernels' input).
    integer_gemm: bool = True

    def run(self, graph: Graph) -> Graph:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}")
        stored: dict[tuple[int, int], tuple[Value, Value | None]] = {}
        stored_kn: dict[int, tuple[Value, np.ndarray]] = {}
        stored_oc: dict[int, tuple[Value, np.ndarray]] = {}
        quantized_x: dict[int, tuple[Value, Value, Value]] = {}
        added: list[Node] = []
        replaced: dict[int, list[Node]] = {}
        for node, index, axis in weight_readers(graph):
            w = node.inputs[index]
            if self.precision == "int8" and self.integer_gemm and multiplies_integers(node, index):
                if id(w) not in stored_kn:
                    stored_kn[id(w)] = _codes_k_by_n(graph, w, axis)
                a = node.inputs[0]
                quantizing = [] if id(a) in quantized_x else [_quantize_dynamically(graph, a, quantized_x)]
                replaced[id(node)] = quantizing + _integer_product(graph, node, *stored_kn[id(w)], *quantized_x[id(a)])
                continue
            if self.precision == "int8" and self.integer_gemm and convolves_integers(node, index):
                if id(w) not in stored_oc:
                    codes, scale = quantize_per_channel(w.const, axis)
                    stored_oc[id(w)] = (_constant(graph, f"{w.name}_int8", codes), scale.reshape(-1))
                x = node.inputs[0]
                quantizing = [] if id(x) in quantized_x else [_quantize_dynamically(graph, x, quantized_x)]
                replaced[id(node)] = quantizing + _integer_conv(graph, node, *stored_oc[id(w)], *quantized_x[id(x)])
                continue
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
        # The integer form takes its node's place, so that its run-time scale comes before its
        # MatMulInteger in graph order (an operand the kernel's epilogue reads must be ready).
        graph.nodes = [n for node in graph.nodes for n in replaced.get(id(node), [node])] + added
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


def multiplies_integers(node: Node, index: int) -> bool:
    """Whether the int8 variant writes this MatMul / Gemm as DynamicQuantizeLinear -> MatMulInteger:
    a float32 activation A of static shape with more than GEMV_ROWS rows, a 2-D weight B."""
    a, w = node.inputs[0], node.inputs[index]
    if index != 1 or node.op_type not in ("MatMul", "Gemm") or len(w.shape) != 2 or a.is_const \
            or a.dtype != dtypes.from_numpy(np.float32) or not a.is_static or len(a.shape) < 2:
        return False
    if node.op_type == "Gemm":
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if node.attrs.get("transA", 0) or (c is not None and not c.is_const and node.attrs.get("beta", 1.0) != 1.0):
            return False
    return int(np.prod(a.shape[:-1])) > GEMV_ROWS


def convolves_integers(node: Node, index: int) -> bool:
    """Whether the int8 variant writes this Conv as DynamicQuantizeLinear -> ConvInteger: a 2-D Conv
    (grouped or not) of a float32 activation X of static shape, with a constant bias or none, and at
    least MIN_CONV_TAPS taps per output."""
    x, w = node.inputs[0], node.inputs[index]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    return index == 1 and node.op_type == "Conv" and node.domain in ("", "ai.onnx") and len(w.shape) == 4 \
        and not x.is_const and x.dtype == dtypes.from_numpy(np.float32) and x.is_static and len(x.shape) == 4 \
        and (bias is None or bias.is_const) and len(node.outputs) == 1 \
        and int(np.prod(w.shape[1:])) >= MIN_CONV_TAPS


def _codes_k_by_n(graph: Graph, w: Value, axis: int) -> tuple[Value, np.ndarray]:
    """The weight's int8 codes as MatMulInteger's B [K, N] and the per-column scale [N]."""
    codes, scale = quantize_per_channel(w.const, axis)
    if axis == 0:               # a Gemm's B with transB: [N, K]
        codes = codes.T
    return _constant(graph, f"{w.name}_int8", codes), scale.reshape(-1)


def _integer_product(graph: Graph, node: Node, codes: Value, column_scale: np.ndarray, quantized: Value,
                     a_scale: Value, a_zero: Value) -> list[Node]:
    """`node` as onnxruntime's DynamicQuantizeMatMul computes it, after A's DynamicQuantizeLinear:
    the nodes that replace it."""
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    bias = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
    if bias is not None and bias.is_const and beta != 1.0:
        bias = _constant(graph, f"{bias.name}_beta", np.asarray(bias.const, np.float32) * np.float32(beta))
    weight_scale = (column_scale * np.float32(alpha)).astype(np.float32)
    return _dequantized_integers(graph, node, "MatMulInteger", [quantized, codes, a_zero], {}, a_scale,
                                 _constant(graph, f"{codes.name}_scale", weight_scale), bias)


def _dequantized_integers(graph: Graph, node: Node, op_type: str, operands: list[Value], attrs: dict,
                          a_scale: Value, weight_scale: Value, bias: Value | None) -> list[Node]:
    """`op_type` (MatMulInteger, ConvInteger) over `operands`, its int32 sums as float32 times
    a_scale * weight_scale [+ bias]: DynamicQuantizeMatMul's tail, the nodes that replace `node`."""
    y = node.outputs[0]
    float32 = dtypes.from_numpy(np.float32)

    def value(suffix: str, dtype: int, shape: tuple) -> Value:
        return Value(graph.fresh_name(f"{y.name}_{suffix}"), dtype, shape)

    def op(op_type: str, inputs: list[Value], outputs: list[Value], **attributes) -> Node:
        return Node(op_type, inputs, outputs, attributes, name=graph.fresh_name(f"{node.name or y.name}_{op_type.lower()}"))
    scale = value("scale", float32, weight_scale.shape)
    total, widened = value("int32", dtypes.from_numpy(np.int32), y.shape), value("sums", float32, y.shape)
    scaled = value("scaled", float32, y.shape) if bias is not None else y
    nodes = [op("Mul", [a_scale, weight_scale], [scale]),
             op(op_type, operands, [total], **attrs),
             op("Cast", [total], [widened], to=float32),
             op("Mul", [widened, scale], [scaled])]
    if bias is not None:
        nodes.append(op("Add", [scaled, bias], [y]))
    return nodes


def _quantize_dynamically(graph: Graph, x: Value, quantized_x: dict[int, tuple[Value, Value, Value]]) -> Node:
    """DynamicQuantizeLinear of `x`, its outputs recorded in `quantized_x` so that every product
    reading `x` (a SqueezeNet fire module's two expand Convs, an attention's Q, K and V projections)
    shares one quantization."""
    float32, uint8 = dtypes.from_numpy(np.float32), dtypes.from_numpy(np.uint8)
    outputs = [Value(graph.fresh_name(f"{x.name}_{suffix}"), dtype, shape)
               for suffix, dtype, shape in (("quantized", uint8, x.shape), ("scale", float32, ()), ("zero", uint8, ()))]
    quantized_x[id(x)] = tuple(outputs)
    return Node("DynamicQuantizeLinear", [x], outputs, name=graph.fresh_name(f"{x.name}_dynamicquantizelinear"))


def _integer_conv(graph: Graph, node: Node, codes: Value, channel_scale: np.ndarray, quantized: Value,
                  x_scale: Value, x_zero: Value) -> list[Node]:
    """`node` as ConvInteger(qX, codes, x_zero) -> Cast -> Mul(x_scale * scale[c]) [-> Add(bias[c])],
    scale and bias shaped [1, C, 1, 1]: the nodes that replace it, after X's DynamicQuantizeLinear."""
    per_channel = (1, codes.shape[0], 1, 1)
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is not None:
        bias = _constant(graph, f"{bias.name}_channels", np.asarray(bias.const, np.float32).reshape(per_channel))
    weight_scale = _constant(graph, f"{codes.name}_scale", channel_scale.reshape(per_channel))
    # ConvInteger pads with x_zero, a tap that adds (x_zero - x_zero) * w = 0: the float Conv's zero padding.
    return _dequantized_integers(graph, node, "ConvInteger", [quantized, codes, x_zero], dict(node.attrs), x_scale,
                                 weight_scale, bias)


def _constant(graph: Graph, base: str, array: np.ndarray) -> Value:
    array = np.ascontiguousarray(array)
    return Value(graph.fresh_name(base), dtypes.from_numpy(array.dtype), tuple(array.shape), const=array)


def narrowed(graph: Graph, precision: str, integer_gemm: bool = True) -> Graph | None:
    """A copy of `graph` with its weights stored in `precision`; None when it has no weights."""
    if not weight_readers(graph):
        return None
    return NarrowWeights(precision, integer_gemm).run(_copy_graph(graph))


def _copy_graph(graph: Graph) -> Graph:
    """A deep copy that shares the (read-only) constant arrays instead of duplicating them."""
    memo = {id(v.const): v.const for v in graph.values() if v.const is not None}
    return copy.deepcopy(graph, memo)
