"""Sliding-block ops without a ready-made kernel: Col2Im (sum image blocks back into an image)
and DeformConv (a convolution whose taps sit at learned fractional offsets)."""

from ir.errors import UnsupportedError
from ir.loops.expr import all_of, binary, cast, in_range, maximum, minimum, select, unary
from ir.ops.registry import CONTRACTION, OTHER, lowering, register

register("Col2Im", kind=OTHER)
register("DeformConv", kind=CONTRACTION)


@lowering("loops", "Col2Im")
def _col2im(b, node):
    """input (N, C * prod(block), L): column l of block offset k adds into image position
    l * stride - pad_begin + k * dilation, where l runs over the blocks' grid row-major."""
    x, y = b.input(node, 0), b.output(node)
    image = [int(v) for v in b.const_input(node, 1).reshape(-1)]
    block = [int(v) for v in b.const_input(node, 2).reshape(-1)]
    rank = len(image)
    strides = [int(s) for s in node.attrs.get("strides", [1] * rank)]
    dilations = [int(d) for d in node.attrs.get("dilations", [1] * rank)]
    pads = [int(p) for p in node.attrs.get("pads", [0] * (2 * rank))]
    grid = [(n + pads[a] + pads[rank + a] - (d * (k - 1) + 1)) // s + 1
            for a, (n, k, s, d) in enumerate(zip(image, block, strides, dilations))]
    batch, channels = y.shape[:2]
    xv = x.view((batch, channels, *block, *grid))
    b.fill(y, 0.0)
    with b.loops((batch, channels), "n") as (n, c), b.loops(block, "k") as k, b.loops(grid, "l") as l:
        at = [li * s - pads[a] + ki * d for a, (li, ki, s, d) in enumerate(zip(l, k, strides, dilations))]
        with b.when(all_of(in_range(p, extent) for p, extent in zip(at, image))):
            b.store(y, (n, c, *at), y[(n, c, *at)] + xv[(n, c, *k, *l)])


@lowering("loops", "DeformConv")
def _deform_conv(b, node):
    """2-D: each tap reads the input bilinearly at its offset position (corners outside the image
    read 0), times its mask (default 1) and weight, summed per output, plus the bias; the
    offsets and masks are laid out (N, offset_group, kH, kW, [2,] oH, oW) as onnx's reference reads them."""
    x, w, offset, bias, mask = (b.input(node, i) for i in range(5))
    y = b.output(node)
    if len(x.shape) != 4:
        raise UnsupportedError(f"{node.describe()}: DeformConv over {len(x.shape) - 2} spatial dims (only 2 are supported)")
    batch, in_channels, height, width = x.shape
    out_channels, group_channels, kh, kw = w.shape
    group = int(node.attrs.get("group", 1))
    offset_group = int(node.attrs.get("offset_group", 1))
    strides = [int(s) for s in node.attrs.get("strides", [1, 1])]
    dilations = [int(d) for d in node.attrs.get("dilations", [1, 1])]
    pads = [int(p) for p in node.attrs.get("pads", [0, 0, 0, 0])]
    out_h, out_w = y.shape[2:]
    per_group_out = out_channels // group
    per_offset_group = in_channels // offset_group
    ov = offset.view((batch, offset_group, kh, kw, 2, out_h, out_w))
    mv = mask.view((batch, offset_group, kh, kw, out_h, out_w)) if mask is not None else None
    t = x.compute_type
    with b.loops(y.shape, "o") as (n, m, i, j):
        acc = b.local(t, bias[(m,)] if bias is not None else 0.0, "acc")
        with b.loop(group_channels, "c") as c, b.loop(kh, "a") as a, b.loop(kw, "e") as e:
            ic = binary("div", m, per_group_out) * group_channels + c
            og = binary("div", ic, per_offset_group)
            h = b.local(t, cast(i * strides[0] - pads[0] + a * dilations[0], t) + ov[n, og, a, e, 0, i, j], "h")
            v = b.local(t, cast(j * strides[1] - pads[1] + e * dilations[1], t) + ov[n, og, a, e, 1, i, j], "w")
            sample = _bilinear(b, x, n, ic, h, v, (height, width), t)
            weight = w[m, c, a, e] * mv[n, og, a, e, i, j] if mv is not None else w[m, c, a, e]
            b.assign(acc, acc + sample * weight)
        b.store(y, (n, m, i, j), acc)


def _bilinear(b, x, n, channel, h, w, extent, t):
    """x[n, channel] at the fractional position (h, w), each of the four corners reading 0 outside."""
    h0 = b.local("i32", cast(unary("floor", h), "i32"), "h0")
    w0 = b.local("i32", cast(unary("floor", w), "i32"), "w0")
    fh, fw = h - cast(h0, t), w - cast(w0, t)
    total = None
    for dh, weight_h in ((0, 1.0 - fh), (1, fh)):
        for dw, weight_w in ((0, 1.0 - fw), (1, fw)):
            rows, cols = h0 + dh, w0 + dw
            inside = all_of((in_range(rows, extent[0]), in_range(cols, extent[1])))
            at = (n, channel, minimum(maximum(rows, 0), extent[0] - 1), minimum(maximum(cols, 0), extent[1] - 1))
            term = select(inside, x[at], 0.0) * (weight_h * weight_w)
            total = term if total is None else total + term
    return total

