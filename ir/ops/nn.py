"""Contractions (the ops that own weights) and the other neural-network ops."""

import math

from ir.ops.registry import CONTRACTION, OTHER, output_elements, register, static_dim, static_numel


def _gemm_weight_axis(node):
    return 0 if node.attrs.get("transB", 0) else 1


# Contractions cost a multiply and an add per weight use: 2 * output elements * reduction length.

def _matmul_flops(node):
    a = node.inputs[0]
    if a is None or not a.shape:
        return output_elements(node)
    return 2 * output_elements(node) * static_dim(a.shape[-1])


def _gemm_flops(node):
    a = node.inputs[0]
    if a is None or not a.shape:
        return output_elements(node)
    return 2 * output_elements(node) * static_dim(a.shape[0] if node.attrs.get("transA", 0) else a.shape[-1])


def _conv_flops(node):
    """Conv weight (M, C/group, k...): each output element reads C/group * prod(k) inputs."""
    w = node.inputs[1]
    if w is None or not w.shape:
        return output_elements(node)
    return 2 * output_elements(node) * math.prod(static_dim(d) for d in w.shape[1:])


def _conv_transpose_flops(node):
    """ConvTranspose weight (C, M/group, k...): each input element feeds M/group * prod(k) outputs."""
    w = node.inputs[1]
    if w is None or not w.shape:
        return output_elements(node)
    return 2 * static_numel(node.inputs[0].shape) * math.prod(static_dim(d) for d in w.shape[1:])


register("MatMul", kind=CONTRACTION, weight_input=1,
         weight_axis=lambda node: -1, output_axis=lambda node: -1, flops=_matmul_flops)
register("Gemm", kind=CONTRACTION, weight_input=1,
         weight_axis=_gemm_weight_axis, output_axis=lambda node: 1, flops=_gemm_flops)
register("Conv", kind=CONTRACTION, weight_input=1,
         weight_axis=lambda node: 0, output_axis=lambda node: 1, flops=_conv_flops)
register("ConvTranspose", kind=CONTRACTION, flops=_conv_transpose_flops)
register("MaxRoiPool", "RoiAlign", "AffineGrid",
         "Attention",
         "RotaryEmbedding", "CenterCropPad", "ImageDecoder",
         "StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer",
         kind=OTHER)


# -- lowerings to loop nests ---------------------------------------------------------------------

from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402

from ir.loops.builder import broadcast_load  # noqa: E402
from ir.loops.contraction import ContractionOperands, ConvSpec, EpilogueSpec, GemmSpec  # noqa: E402
from ir.loops.expr import all_of, fma, in_range, maximum, minimum, select  # noqa: E402
from ir.ops.registry import epilogue_of, lowering  # noqa: E402
from ir.ops.gelu_pattern import erf_gelu_nodes  # noqa: E402
from ir.ops.residual_pattern import residual_operand  # noqa: E402
from ir.ops.windows import pad_buffer, window_geometry  # noqa: E402


@lowering("loops", "MatMul")
def _matmul(b, node):
    if _matmul_as_gemm(b, node):
        return
    a, w, y = b.input(node, 0), b.input(node, 1), b.output(node)
    a_shape, w_shape = a.shape, w.shape
    if len(a_shape) == 1:
        a = a.view((1,) + a_shape)
    if len(w_shape) == 1:
        w = w.view(w_shape + (1,))
    batch = tuple(np.broadcast_shapes(a.shape[:-2], w.shape[:-2]))
    (m, k), n = a.shape[-2:], w.shape[-1]
    y = y.view(batch + (m, n))
    _zero_then_accumulate(b, y, batch, m, k, n,
                          lambda bt, i, kk: _batched(a, bt, len(batch))[(i, kk)],
                          lambda bt, kk, j: _batched(w, bt, len(batch))[(kk, j)])


@lowering("loops", "Gemm")
def _gemm(b, node):
    if _gemm_as_gemm(b, node):
        return
    a, w, c, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    if node.attrs.get("transA", 0):
        a = _transposed(b, node, 0)
    if node.attrs.get("transB", 0):
        w = _transposed(b, node, 1)
    (m, k), n = a.shape, w.shape[1]
    with b.loops((m, n)) as (i, j):
        init = 0.0
        if c is not None and beta != 0.0:
            init = broadcast_load(c, (m, n), (i, j)) * beta if beta != 1.0 else broadcast_load(c, (m, n), (i, j))
        b.store(y, (i, j), init)
    with b.loop(m, "i") as i, b.loop(k, "k") as kk, b.loop(n, "j") as j:
        lhs = a[i, kk] * alpha if alpha != 1.0 else a[i, kk]
        b.store(y, (i, j), fma(lhs, w[kk, j], y[i, j]))


# -- the target's ready-made kernels, where it has them (float32 only) --------------------------

def _f32(*values) -> bool:
    return all(v is None or v.dtype == 1 for v in values)   # TensorProto.FLOAT


def _fused_epilogue(b, node, bias_width: int | None = None):
    """What of the ops after a GEMM or Conv `node` its kernel can do, as the registry's `epilogue`
    entries say: an Add of a constant per-column bias (when `bias_width` is given), then an Add of a
    residual (see `_residual`), then an activation (a Relu or an exact GELU; also GELU's erf
    diamond x * 0.5 * (1 + erf(x / sqrt 2)), see `erf_gelu_nodes`). Only nodes the fusion groups
    put with `node` (`LoopBuilder.fused`): the kernel absorbs a chain of its group, or, from the
    residual Add on, of the group FuseGroups gave that Add to (see `_residual`). Returns (output
    buffer, bias buffer or None, residual buffer or None, activation or None); the absorbed nodes
    then emit nothing."""
    value, group = node.outputs[0], node
    bias, residual, out = None, None, None
    reader = b.sole_reader(value)
    if bias_width is not None and _absorbable(reader, "bias") and _f32(*reader.inputs) and b.fused(group, reader):
        other = reader.inputs[1] if reader.inputs[0] is value else reader.inputs[0]
        if other.is_const and other.const.size == bias_width and other.shape[-1:] == (bias_width,) \
                and tuple(reader.outputs[0].shape) == tuple(value.shape):
            bias = b.constant(np.asarray(other.const, dtype=np.float32).reshape(-1), other.name + "_bias")
            out = b.absorb(reader)
            value, reader = reader.outputs[0], b.sole_reader(reader.outputs[0])
    if (other := _residual(b, node, reader, value)) is not None:
        if not b.fused(group, reader):
            group = reader
        residual = b.buffer(other)
        out = b.absorb(reader)
        value, reader = reader.outputs[0], b.sole_reader(reader.outputs[0])
    if (activation := _absorbable(reader, "activation")) and _f32(reader.outputs[0]) and b.fused(group, reader):
        return b.absorb(reader), bias, residual, activation
    if _f32(value) and (gelu := erf_gelu_nodes(value, b.users, b.output_ids)) \
            and all(_f32(n.outputs[0]) and b.fused(group, n) for n in gelu):
        for gelu_node in gelu:
            out = b.absorb(gelu_node)
        return out, bias, residual, "gelu"
    return (out if out is not None else b.buffer(value)), bias, residual, None


def _absorbable(reader, part: str):
    """`part` ("bias" or "activation") of what the registry says a kernel may absorb of `reader`;
    falsy when there is no reader or it cannot be that part."""
    epilogue = epilogue_of(reader) if reader is not None else None
    return getattr(epilogue, part) if epilogue is not None else None


def _residual(b, anchor, add, value):
    """The other operand of `add` when it adds a residual to `value` (the product so far) by the rule
    of `residual_operand`, and everything is float32. The kernel reads that operand while it writes
    the output, so it must already be computed when the anchor's kernel runs: its producer comes
    before the anchor in graph order (kernels run in that order; a producer after it, though
    independent of it, would not yet have run). The memory plan never overlaps two temporaries one
    kernel touches, so the residual and the output stay apart."""
    if add is None or not _f32(*add.inputs, add.outputs[0]):
        return None
    other = residual_operand(add, lambda v: v is value)
    # FuseGroups gives the Add to the first of its two producers' groups in graph order, taking the
    # other operand as the residual; the kernel must run after the residual is computed, so it may
    # be this anchor's kernel that absorbs the Add with the roles swapped.
    if other is None or not (b.fused(anchor, add) or (other.producer is not None and b.fused(other.producer, add))):
        return None
    anchor_at = b.position(anchor)
    if anchor_at is None:  # a node of a branch or a function body: no graph order to rely on
        return None
    producer_at = b.position(other.producer) if other.producer is not None else None
    if producer_at is not None and producer_at >= anchor_at:   # None: produced outside this graph
        return None
    return other


def _static(*values) -> bool:
    return all(v is None or v.is_static for v in values)


def _ints(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def _with_epilogue(spec, bias, residual, activation):
    return replace(spec, epilogue=EpilogueSpec(bias is not None, residual is not None, activation))


def _matmul_as_gemm(b, node) -> bool:
    av, wv = node.inputs[0], node.inputs[1]
    if not _f32(*node.inputs, node.outputs[0]) or not _static(av, wv):
        return False
    narrow = b.narrow_weight(wv)
    if (wv.is_const or narrow is not None) and len(wv.shape) == 2:
        k, n = _ints(wv.shape)
        spec = _offered(b, GemmSpec(int(np.prod(av.shape[:-1], dtype=np.int64)), n, k), narrow)
        if spec is not None:
            packed = _gemm_weight(b, spec, wv, narrow)
            y, bias, residual, activation = _fused_epilogue(b, node, bias_width=n)
            b.call_contraction(_with_epilogue(spec, bias, residual, activation),
                               ContractionOperands(b.buffer(av), packed, y, bias, residual), av.name, wv.name)
            return True
        if wv.is_const:
            return False
    if len(av.shape) == len(wv.shape) >= 2 and list(av.shape[:-2]) == list(wv.shape[:-2]) and not av.is_const:
        (m, k), n = _ints(av.shape[-2:]), int(wv.shape[-1])
        spec = GemmSpec(m, n, k, batch=int(np.prod(av.shape[:-2], dtype=np.int64)), constant_b=False)
        if not b.offers(spec):
            return False
        b.call_contraction(spec, ContractionOperands(b.buffer(av), b.contraction_weight(spec, wv), b.output(node)),
                           av.name, wv.name)
        return True
    return False


def _offered(b, spec: GemmSpec, narrow) -> GemmSpec | None:
    """`spec`, reading B narrow when B is a widened narrow weight (`narrow`), if the target has
    that kernel; else None. A narrow B the target cannot read narrow stays the float32 output of
    its widening (an activation)."""
    if narrow is not None:
        spec = replace(spec, b_format=narrow.format)
    return spec if b.offers(spec) else None


def _gemm_weight(b, spec: GemmSpec, wv, narrow):
    """B packed for the kernel: the narrow constant itself where `spec` reads it narrow (its
    widening then never runs), else the float32 constant."""
    if spec.b_format == "f32":
        return b.contraction_weight(spec, wv)
    b.read_narrow(wv)
    return b.contraction_weight(spec, wv, narrow)


def _gemm_as_gemm(b, node) -> bool:
    av, wv, cv = node.inputs[0], node.inputs[1], node.inputs[2] if len(node.inputs) > 2 else None
    narrow = b.narrow_weight(wv)
    if not _f32(*node.inputs, node.outputs[0]) or not (wv.is_const or narrow is not None) or not _static(node.outputs[0], wv):
        return False
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    trans_a, trans_b = bool(node.attrs.get("transA", 0)), bool(node.attrs.get("transB", 0))
    (m, n), (rows, columns) = _ints(node.outputs[0].shape), _ints(wv.shape)
    spec = _offered(b, GemmSpec(m, n, columns if trans_b else rows, trans_a=trans_a, trans_b=trans_b), narrow)
    if spec is None:
        return False
    y = b.output(node)
    bias = None
    if cv is not None and beta != 0.0:
        if not cv.is_const or int(np.asarray(cv.const).size) not in (1, n) or (len(cv.shape) == 2 and cv.shape[0] != 1):
            return False
        bias = b.constant((np.broadcast_to(np.asarray(cv.const, dtype=np.float64).reshape(-1), (n,)) * beta)
                          .astype(np.float32), cv.name + "_bias")
    if spec.b_format != "f32":      # alpha is 1 (narrow_weight_chains)
        packed = _gemm_weight(b, spec, wv, narrow)
    else:
        weights = np.asarray(wv.const, dtype=np.float32) * np.float32(alpha) if alpha != 1.0 else np.asarray(wv.const)
        packed = b.contraction_weight(spec, wv, weights)
    y, _, residual, activation = _fused_epilogue(b, node)
    b.call_contraction(_with_epilogue(spec, bias, residual, activation),
                       ContractionOperands(b.input(node, 0), packed, y, bias, residual), av.name, wv.name)
    return True


def _conv_as_intrinsic(b, node) -> bool:
    xv, wv, yv = node.inputs[0], node.inputs[1], node.outputs[0]
    if not _f32(*node.inputs, yv) or len(wv.shape) != 4 or not _static(xv, wv, yv):
        return False
    (batch, channels, height, width), (out_channels, _, *kernel) = _ints(xv.shape), _ints(wv.shape)
    geo = window_geometry(node, (height, width), kernel, _ints(yv.shape)[2:])
    spec = ConvSpec(batch=batch, in_channels=channels, height=height, width=width,
                    out_channels=out_channels, kernel=tuple(kernel), strides=tuple(geo.strides),
                    pads=(geo.pads_begin[0], geo.pads_begin[1], geo.pads_end[0], geo.pads_end[1]),
                    dilations=tuple(geo.dilations), groups=int(node.attrs.get("group", 1)),
                    constant_weight=wv.is_const)
    if not b.offers(spec):
        return False
    x = b.input(node, 0)
    y, _, residual, activation = _fused_epilogue(b, node)
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    spec = replace(spec, epilogue=EpilogueSpec(has_bias, residual is not None, activation))
    w = b.contraction_weight(spec, wv)
    b.call_contraction(spec, ContractionOperands(x, w, y, b.input(node, 2), residual), x.name, wv.name)
    return True


def _transposed(b, node, i):
    """A transposed operand: a transposed copy of a constant (so the inner loop reads contiguous
    rows), or a transposing copy at run time."""
    v = node.inputs[i]
    if v.is_const:
        return b.constant(np.ascontiguousarray(np.asarray(v.const).T), v.name + "_t")
    src = b.buffer(v)
    dst = b.temp(src.dtype, src.shape[::-1], v.name + "_t")
    with b.loops(dst.shape) as (r, c):
        b.store(dst, (r, c), src[c, r])
    return dst


def _batched(buf, batch_idx, batch_rank):
    """A 2-D view of `buf` at the broadcast batch position `batch_idx`."""
    class _Rows:
        def __getitem__(self, ij):
            lead = len(buf.shape) - 2
            own = batch_idx[batch_rank - lead:] if lead else []
            idx = [0 if d == 1 else v for d, v in zip(buf.shape[:lead], own)]
            return buf[tuple(idx) + tuple(ij)]
    return _Rows()


def _zero_then_accumulate(b, y, batch, m, k, n, lhs, rhs):
    """y[bt, i, j] = sum_k lhs(bt, i, k) * rhs(bt, k, j), with j innermost so rows stream."""
    b.fill(y, 0.0)
    with b.loops(batch, "b") as bt, b.loop(m, "i") as i, b.loop(k, "k") as kk, b.loop(n, "j") as j:
        b.store(y, (*bt, i, j), fma(lhs(bt, i, kk), rhs(bt, kk, j), y[(*bt, i, j)]))


@lowering("loops", "Conv")
def _conv(b, node):
    if _conv_as_intrinsic(b, node):
        return
    x, w, bias, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    group = int(node.attrs.get("group", 1))
    n_batch, channels, *spatial = x.shape
    out_channels, group_channels, *kernel = w.shape
    geo = window_geometry(node, spatial, kernel, y.shape[2:])
    xp = pad_buffer(b, x, geo.pads_begin, geo.padded, 0.0)
    per_group = out_channels // group
    with b.loops(y.shape) as (nn, m, *o):
        b.store(y, (nn, m, *o), bias[m] if bias is not None else 0.0)
    with b.loop(n_batch, "n") as nn, b.loop(group, "g") as g, b.loop(per_group, "m") as mg, \
            b.loop(group_channels, "c") as c, b.loops(kernel, "k") as k, b.loops(y.shape[2:], "o") as o:
        m = g * per_group + mg
        at = [oi * s + ki * d for oi, ki, s, d in zip(o, k, geo.strides, geo.dilations)]
        b.store(y, (nn, m, *o), fma(w[(m, c, *k)], xp[(nn, g * group_channels + c, *at)], y[(nn, m, *o)]))


@lowering("loops", "ConvTranspose")
def _conv_transpose(b, node):
    """Scatter form: every input pixel adds its kernel-weighted footprint into a full-size
    accumulator (no bounds checks), which is then cropped by the padding into the output."""
    x, w, bias, y = b.input(node, 0), b.input(node, 1), b.input(node, 2), b.output(node)
    group = int(node.attrs.get("group", 1))
    n_batch, channels, *spatial = x.shape
    _, per_group_out, *kernel = w.shape
    out_spatial = y.shape[2:]
    rank = len(spatial)
    strides = [int(s) for s in node.attrs.get("strides", [1] * rank)]
    dilations = [int(d) for d in node.attrs.get("dilations", [1] * rank)]
    out_pad = [int(p) for p in node.attrs.get("output_padding", [0] * rank)]
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if "pads" in node.attrs and auto_pad == "NOTSET" and "output_shape" not in node.attrs:
        begin = [int(p) for p in node.attrs["pads"][:rank]]
    else:
        begin = []
        for n, k, s, d, o, op in zip(spatial, kernel, strides, dilations, out_spatial, out_pad):
            total = s * (n - 1) + op + (k - 1) * d + 1 - o
            begin.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
    full = [(n - 1) * s + (k - 1) * d + 1 for n, k, s, d in zip(spatial, kernel, strides, dilations)]
    acc = b.temp(y.dtype, (n_batch, y.shape[1], *full), y.name + "_full")
    b.fill(acc, 0.0)
    per_group_in = channels // group
    with b.loop(n_batch, "n") as nn, b.loop(group, "g") as g, b.loop(per_group_in, "c") as c, \
            b.loop(per_group_out, "m") as m, b.loops(kernel, "k") as k, b.loops(spatial, "i") as i:
        ic, oc = g * per_group_in + c, g * per_group_out + m
        at = [ii * s + kk * d for ii, kk, s, d in zip(i, k, strides, dilations)]
        b.store(acc, (nn, oc, *at), fma(x[(nn, ic, *i)], w[(ic, m, *k)], acc[(nn, oc, *at)]))
    with b.loops(y.shape) as (nn, oc, *o):
        src = [v + p for v, p in zip(o, begin)]
        inside = all_of(in_range(s_, e) for s_, e in zip(src, full))
        clamped = [minimum(maximum(s_, 0), e - 1) for s_, e in zip(src, full)]
        value = select(inside, acc[(nn, oc, *clamped)], 0.0)
        b.store(y, (nn, oc, *o), value + bias[oc] if bias is not None else value)


