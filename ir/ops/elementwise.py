"""Elementwise ops: each output element depends on the same (broadcast) position of the inputs."""

from ir.ops.registry import ELEMENTWISE, RANDOM, Epilogue, register


def _exact_gelu(node) -> bool:
    return node.attrs.get("approximate", "none") == "none"


# What a GEMM or Conv kernel can absorb after it (see `_fused_epilogue` in `nn`): a bias Add, a
# residual Add or Sum (`residual_pattern`), then one activation. The kernels compute GELU's exact
# (erf) form only, not the tanh approximation.
register("Add", kind=ELEMENTWISE, epilogue=Epilogue(bias=True, residual=True))
register("Sum", kind=ELEMENTWISE, epilogue=Epilogue(residual=True))
register("Relu", kind=ELEMENTWISE, epilogue=Epilogue(activation="relu"))
register("Gelu", kind=ELEMENTWISE, epilogue=Epilogue(activation="gelu", applies=_exact_gelu))

register("Abs", "Neg", "Reciprocal", "Floor", "Ceil", "Round", "Sqrt", "Exp", "Log", "Sign",
         "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "Sigmoid",
         "HardSigmoid", "HardSwish", "Tanh", "Softplus", "Softsign", "Mish", "Erf",
         "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
         "Not", "IsNaN", "IsInf", "Clip", "Cast", "CastLike", "BitwiseNot",
         "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Mean",
         "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor",
         "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Where",
         "QuantizeLinear", "DequantizeLinear", "Shrink", "Swish",
         kind=ELEMENTWISE)

register("BitCast", kind=ELEMENTWISE)
register("Dropout", kind=ELEMENTWISE)  # inference mode is Identity; Simplify removes it

register("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
         "Bernoulli", kind=RANDOM)


# -- lowerings to loop nests: one expression per op over the broadcast inputs --------------------

import math  # noqa: E402

import numpy as np  # noqa: E402

from ir.errors import UnsupportedError  # noqa: E402
from ir.loops.expr import (Const, binary, cast, const, eq, ge, gt, le, logical_and, logical_or, lt,  # noqa: E402
                           maximum, minimum, ne, reinterpret, select, unary)
from ir.ops.gelu_pattern import erf_gelu_nodes  # noqa: E402
from ir.ops.registry import lowering  # noqa: E402


def _exp(x): return unary("exp", x)
def _log(x): return unary("log", x)
def _sigmoid(x): return 1.0 / (1.0 + _exp(-x))
def _softplus(x): return select(gt(x, 20.0), x, _log(1.0 + _exp(x)))
def _attr(node, key, default): return node.attrs.get(key, default)


def _sign(x):
    return select(gt(x, 0), 1, select(lt(x, 0), const(-1, x.type), 0))


def _gelu(node, x):
    if _attr(node, "approximate", "none") == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + unary("tanh", inner))
    return 0.5 * x * (1.0 + unary("erf", x * (1.0 / math.sqrt(2.0))))


def _int_mod(a, b):
    """Python-style remainder (sign of the divisor), ONNX Mod with fmod=0 on integers."""
    r = a % b
    return select(logical_and(ne(r, 0), ne(lt(r, 0), lt(b, 0))), r + b, r)


def _pow(x, y):
    if y.type != x.type:
        y = cast(y, x.type)
    if x.type in ("i32", "i64"):
        return cast(unary("nearest", _fpow(cast(x, "f64"), cast(y, "f64"))), x.type)
    return _fpow(x, y)


def _fpow(x, y):
    if isinstance(y, Const) and y.value == 2.0:
        return x * x
    if isinstance(y, Const) and y.value == 0.5:
        return unary("sqrt", x)
    if isinstance(y, Const) and y.value == 1.0:
        return x
    return binary("pow", x, y)


def _fold(fn, xs):
    acc = xs[0]
    for x in xs[1:]:
        acc = fn(acc, x)
    return acc


_SELU_ALPHA, _SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875

ELEMENTWISE_EXPRESSIONS = {
    "Abs": lambda n, x: unary("abs", x),
    "Neg": lambda n, x: -x,
    "Reciprocal": lambda n, x: 1.0 / x,
    "Floor": lambda n, x: unary("floor", x),
    "Ceil": lambda n, x: unary("ceil", x),
    "Round": lambda n, x: unary("nearest", x),
    "Sqrt": lambda n, x: unary("sqrt", x),
    "Exp": lambda n, x: _exp(x),
    "Log": lambda n, x: _log(x),
    "Sign": lambda n, x: _sign(x),
    "Relu": lambda n, x: maximum(x, 0),
    "LeakyRelu": lambda n, x: select(lt(x, 0), x * _attr(n, "alpha", 0.01), x),
    "PRelu": lambda n, x, slope: select(lt(x, 0), x * slope, x),
    "Elu": lambda n, x: select(lt(x, 0), _attr(n, "alpha", 1.0) * (_exp(x) - 1.0), x),
    "Selu": lambda n, x: select(le(x, 0), _attr(n, "gamma", _SELU_GAMMA) * (_attr(n, "alpha", _SELU_ALPHA) * _exp(x)
                                                                            - _attr(n, "alpha", _SELU_ALPHA)),
                                _attr(n, "gamma", _SELU_GAMMA) * x),
    "Celu": lambda n, x: maximum(x, 0.0) + minimum(0.0, _attr(n, "alpha", 1.0)
                                                   * (_exp(x / _attr(n, "alpha", 1.0)) - 1.0)),
    "ThresholdedRelu": lambda n, x: select(gt(x, _attr(n, "alpha", 1.0)), x, 0.0),
    "Sigmoid": lambda n, x: _sigmoid(x),
    "HardSigmoid": lambda n, x: maximum(0.0, minimum(1.0, _attr(n, "alpha", 0.2) * x + _attr(n, "beta", 0.5))),
    "HardSwish": lambda n, x: x * maximum(0.0, minimum(1.0, x * (1.0 / 6.0) + 0.5)),
    "Tanh": lambda n, x: unary("tanh", x),
    "Softplus": lambda n, x: _softplus(x),
    "Softsign": lambda n, x: x / (1.0 + unary("abs", x)),
    "Gelu": _gelu,
    "Mish": lambda n, x: x * unary("tanh", _softplus(x)),
    "Swish": lambda n, x: x * _sigmoid(x * _attr(n, "alpha", 1.0)),
    "Erf": lambda n, x: unary("erf", x),
    **{op: (lambda name: lambda n, x: unary(name, x))(op.lower())
       for op in ("Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")},
    "Not": lambda n, x: unary("not", x),
    "BitwiseNot": lambda n, x: _xor(x, -1),
    "IsNaN": lambda n, x: unary("isnan", x),
    "IsInf": lambda n, x: logical_or(unary("isinf_pos", x) if _attr(n, "detect_positive", 1) else 0,
                                     unary("isinf_neg", x) if _attr(n, "detect_negative", 1) else 0),
    "Shrink": lambda n, x: select(lt(x, -_attr(n, "lambd", 0.5)), x + _attr(n, "bias", 0.0),
                                  select(gt(x, _attr(n, "lambd", 0.5)), x - _attr(n, "bias", 0.0), 0.0)),
    "Add": lambda n, a, b: a + b,
    "Sub": lambda n, a, b: a - b,
    "Mul": lambda n, a, b: a * b,
    "Div": lambda n, a, b: a / b,
    "Pow": lambda n, a, b: _pow(a, b),
    "Mod": lambda n, a, b: a % b if _attr(n, "fmod", 0) else _int_mod(a, b),
    "Max": lambda n, *xs: _fold(maximum, xs),
    "Min": lambda n, *xs: _fold(minimum, xs),
    "Sum": lambda n, *xs: _fold(lambda a, b: a + b, xs),
    "Mean": lambda n, *xs: _fold(lambda a, b: a + b, xs) / float(len(xs)),
    "Equal": lambda n, a, b: eq(a, b),
    "Less": lambda n, a, b: lt(a, b),
    "LessOrEqual": lambda n, a, b: le(a, b),
    "Greater": lambda n, a, b: gt(a, b),
    "GreaterOrEqual": lambda n, a, b: ge(a, b),
    "And": lambda n, a, b: logical_and(a, b),
    "Or": lambda n, a, b: logical_or(a, b),
    "Xor": lambda n, a, b: _xor(a, b),
    "BitwiseAnd": lambda n, a, b: logical_and(a, b),
    "BitwiseOr": lambda n, a, b: logical_or(a, b),
    "BitwiseXor": lambda n, a, b: _xor(a, b),
    "Where": lambda n, c, a, b: select(c, a, b),
}


def _xor(a, b):
    return binary("xor", a, b)




def _lower_expression(fn):
    return lambda b, node: b.elementwise(node, lambda *xs: fn(node, *xs))


def _lower_gelu_entry(fn):
    """Mul and Div, which may start GELU's erf diamond: the whole diamond as one loop when no
    kernel absorbs it (dynamically quantized MiniLM's FFN, whose integer GEMM ends in a Mul and an
    Add), else the op alone."""
    def lower(b, node):
        if not _erf_gelu_as_one_loop(b, node):
            b.elementwise(node, lambda *xs: fn(node, *xs))
    return lower


def _erf_gelu_as_one_loop(b, node) -> bool:
    """The five nodes of x * 0.5 * (1 + erf(x / sqrt 2)) that `node` belongs to (see
    `erf_gelu_nodes`) as one loop over x: each node's own expression in graph order, so the result
    is bit for bit the five loops', without four stores and reloads of the [seq, 4 * hidden]
    activation. The loop runs where the first of them would: it reads only x and constants, and
    the four intermediate values are read by none but the five, so no fusion group is needed (the
    groups split the diamond when x has no anchor before it)."""
    for x in node.present_inputs:
        if x.is_const or x.dtype != 1:         # TensorProto.FLOAT
            continue
        nodes = erf_gelu_nodes(x, b.users, b.output_ids)
        if not nodes or not any(n is node for n in nodes):
            continue
        source = b.buffer(x)
        for member in nodes:
            out = b.absorb(member)
        with b.loop(out.numel) as i:
            values = {id(x): source.at(i)}
            for member in nodes:
                args = [values[id(v)] if id(v) in values else float(np.asarray(v.const).reshape(-1)[0])
                        for v in member.inputs]
                values[id(member.outputs[0])] = ELEMENTWISE_EXPRESSIONS[member.op_type](member, *args)
            b.store_flat(out, i, values[id(nodes[-1].outputs[0])])
        return True
    return False


for _op, _fn in ELEMENTWISE_EXPRESSIONS.items():
    lowering("loops", _op)((_lower_gelu_entry if _op in ("Mul", "Div") else _lower_expression)(_fn))


@lowering("loops", "Clip")
def _clip(b, node):
    low, high = node.attrs.get("min"), node.attrs.get("max")   # opset < 11 keeps the bounds in attributes

    def clip(x, lo=None, hi=None):
        lo = lo if lo is not None else low
        hi = hi if hi is not None else high
        if lo is not None:
            x = maximum(x, lo)
        if hi is not None:
            x = minimum(x, hi)
        return x
    b.elementwise(node, clip)


@lowering("loops", "Cast", "CastLike")
def _cast(b, node):
    out = b.output(node)
    if out.dtype == "bool":
        b.elementwise(node, lambda x, *_: ne(x, 0), inputs=[0])
    else:
        b.elementwise(node, lambda x, *_: cast(x, out.compute_type), inputs=[0])


@lowering("loops", "Dropout")
def _dropout(b, node):
    """Inference: the data passes through and the mask, if asked for, is all true."""
    training = node.inputs[2] if len(node.inputs) > 2 else None
    if training is not None and (not training.is_const or bool(training.const)):
        raise UnsupportedError(f"{node.describe()}: Dropout in training mode (random) is not supported")
    b.alias(node.outputs[0], b.input(node, 0))
    if len(node.outputs) > 1 and node.outputs[1].name:
        b.fill(b.output(node, 1), 1)


def _per_axis(b, node, buf, x_shape, idx):
    """A quantisation parameter at `idx`: a scalar, one value per `axis`, or blocks along it."""
    if buf.numel == 1:
        return buf.at(0)
    axis = int(node.attrs.get("axis", 1)) % len(x_shape)
    if len(buf.shape) == 1:
        return buf[(idx[axis],)]
    block = int(node.attrs.get("block_size", 0)) or 1
    return buf[tuple(binary("div", v, block) if d == axis else v for d, v in enumerate(idx))]


@lowering("loops", "DequantizeLinear")
def _dequantize(b, node):
    x, scale, zero, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    t = y.compute_type
    with b.loops(y.shape) as idx:
        v = cast(x[tuple(idx)], t)
        if zero is not None:
            v = v - cast(_per_axis(b, node, zero, x.shape, idx), t)
        b.store(y, idx, v * cast(_per_axis(b, node, scale, x.shape, idx), t))


@lowering("loops", "QuantizeLinear")
def _quantize(b, node):
    import numpy as np
    x, scale, zero, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    info = np.iinfo(np.dtype(y.dtype))
    with b.loops(y.shape) as idx:
        v = unary("nearest", cast(x[tuple(idx)], "f32") / cast(_per_axis(b, node, scale, x.shape, idx), "f32"))
        if zero is not None:
            v = v + cast(_per_axis(b, node, zero, x.shape, idx), "f32")
        if y.dtype == "uint8":
            b.store(y, idx, uint8_of(v))
        elif y.dtype == "int8":
            b.store(y, idx, int8_of(v))
        else:
            b.store(y, idx, cast(minimum(maximum(v, float(info.min)), float(info.max)), y.compute_type))


def uint8_of(q):
    """An integral f32 clamped to [0, 255] as an i32 whose low byte is that value, bit for bit what
    cast(min(max(q, 0), 255), i32) stores in a byte (a NaN q stores 0 either way). The clamps are
    selects, which SIMD128 runs as one maxps/minps each (pmax/pmin; the NaN-propagating min/max are
    long sequences on x86), and the conversion adds 2^23 and reads the bits (k in the low mantissa
    bits) instead of the saturating truncation, another long sequence: about 2.8x faster
    quantisation."""
    return reinterpret(_clamped(q, 0.0, 255.0) + 8388608.0, "i32")


def int8_of(q):
    """`uint8_of` for [-128, 127]: 1.5 * 2^23 + k holds k in its low bits as two's complement. A NaN
    q stores -128, as onnxruntime's QuantizeLinear gives it (the saturating conversion gave 0)."""
    return reinterpret(_clamped(q, -128.0, 127.0) + 12582912.0, "i32")


def _clamped(q, low: float, high: float):
    lo, hi = const(low, "f32"), const(high, "f32")
    above = select(gt(q, lo), q, lo)               # NaN: the comparison fails, low
    return select(lt(above, hi), above, hi)


@lowering("loops", "BitShift")
def _bit_shift(b, node):
    """Shifts by a negative amount or by the bit width or more give 0 (-1 for a negative signed
    value shifted right), where the hardware would take the amount modulo the width."""
    import numpy as np
    dtype = np.dtype(b.input(node, 0).dtype)
    bits, signed = np.iinfo(dtype).bits, dtype.kind == "i"
    left = _attr(node, "direction", "LEFT") == "LEFT"

    def shift(a, s):
        out_of_range = logical_or(lt(s, 0), ge(s, bits))
        if left:
            return select(out_of_range, 0, binary("shl", a, s))
        fill = select(lt(a, 0), const(-1, a.type), 0) if signed else 0
        return select(out_of_range, fill, binary("sar" if signed else "shr", a, s))
    b.elementwise(node, shift)


@lowering("loops", "BitCast")
def _bit_cast(b, node):
    """Same-width integers keep their bits through a plain conversion (loads widen, stores wrap);
    floats and integers swap them with a reinterpretation."""
    x, y = b.input(node, 0), b.output(node)
    if {x.dtype, y.dtype} & {"float16", "bfloat16"}:
        raise UnsupportedError(f"{node.describe()}: BitCast of 16-bit floats is not supported")
    float_side = {x.compute_type, y.compute_type} & {"f32", "f64"}
    if not float_side or x.compute_type == y.compute_type:
        b.elementwise(node, lambda v: cast(v, y.compute_type))
    elif y.compute_type in ("f32", "f64"):      # integer bits -> float (uint32 computes in i64)
        same_width = "i32" if y.compute_type == "f32" else "i64"
        b.elementwise(node, lambda v: reinterpret(cast(v, same_width), y.compute_type))
    else:
        same_width = "i32" if x.compute_type == "f32" else "i64"
        b.elementwise(node, lambda v: cast(reinterpret(v, same_width), y.compute_type))
