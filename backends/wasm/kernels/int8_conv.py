"""8-bit Conv2D (ConvInteger, QLinearConv) on the dot-product tiles of the integer GEMM.

Per image and group, Y[oc, p] = sum_k W'[oc, k] * (col[k, p] - x_zero), k over (input channel,
ky, kx) of the group and p over output pixels (oy, ox): kernels/int8_gemm.py's product with its
operands' roles turned round, so that C is the NCHW output itself, as in the float im2col Conv
(kernels/conv.py). The weight W' (zero point subtracted by the lowering) is the A side, packed at
compile time by `pack_integer_conv_weight`: per group, 4-channel groups [ceil(M/4)][ceil(K/2)][4][2]
int16, the channels past M and the k past K zero. The input is the B side, packed at run time per
group into 8-pixel panels [ceil(P/8)][ceil(K/2)][8][2] int16 of x - x_zero (`$name_pack`,
kernels/int8_panels.py) from the
byte im2col matrix col[C*KH*KW, P] (`$name_im2col`: the padding holds x_zero, which packs to 0, as
the loop nest's padded buffer does) or, for a 1x1 stride-1 unpadded Conv, from the input itself.

The tiles' k loops are int8_gemm's `render_k_function`; panels outside, channel groups inside. The
epilogue stores a tile's 4 channels x 8 pixels as int32, or adds the channel's int32 bias and
requantises in float32 in the loop nest's order: scale[oc] = (x_scale * w_scale[oc]) / y_scale,
y = saturate(nearest(float(acc + bias[oc]) * scale[oc]) + y_zero). The sums are exact (products and
pair sums of 16-bit values in -255..255 fit, and int32 addition wraps alike in any order), so the
output is bit-identical to the loop nest's. Images and groups are run-time loops, so a depthwise
Conv (as many groups as channels, M = 1, K = KH*KW) is one small function too.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from backends.wasm.kernels.conv import Conv2dSpec
from backends.wasm.kernels.int8_gemm import ROWS, TILE_BYTES, groups, render_k_function, store_int32_tile, tile_grid, tile_heights
from backends.wasm.kernels.int8_panels import PANEL, counted_loop, pairs, panels, render_pack_panels
from ir.loops.contraction import ConvSpec, IntegerConvSpec

@dataclass(frozen=True)
class IntegerConvOffsets:
    """Where the operands lie: x, the packed weight, y, the scratch (`integer_conv_scratch_bytes`:
    the byte im2col, None for a 1x1 Conv that reads x itself; the packed panels of one group; the
    tile; the per-channel scales, None without requantisation) and the quantisation operands (None:
    absent)."""
    x: int
    w_packed: int
    y: int
    col: int | None
    b_packed: int
    tile: int
    scales: int | None = None
    x_zero: int | None = None
    x_scale: int | None = None
    w_scale: int | None = None
    y_scale: int | None = None
    y_zero: int | None = None
    bias: int | None = None


def geometry_of(spec: IntegerConvSpec) -> Conv2dSpec:
    return Conv2dSpec(**{f.name: getattr(spec.conv, f.name) for f in dataclasses.fields(ConvSpec)})


def _dims(spec: IntegerConvSpec) -> tuple[Conv2dSpec, int, int, int]:
    """(geometry, M: output channels per group, N: output pixels, K: taps per output)."""
    geo = geometry_of(spec)
    return geo, geo.out_channels // geo.groups, geo.pixels, geo.gemm_k


def pack_integer_conv_weight(spec: IntegerConvSpec, weight: np.ndarray) -> np.ndarray:
    """W' ([OC, C/g, KH, KW], values in -255..255) as int16 4-channel groups per conv group,
    [g][ceil(M/4)][ceil(K/2)][4][2], as bytes."""
    geo, m, _, k = _dims(spec)
    w = np.asarray(weight, np.int64).reshape(geo.groups, m, k)
    if w.size and (w.min() < -32768 or w.max() > 32767):
        raise ValueError("W' does not fit 16 bits")
    padded = np.zeros((geo.groups, ROWS * groups(m), 2 * pairs(k)), "<i2")
    padded[:, :m, :k] = w
    packed = padded.reshape(geo.groups, groups(m), ROWS, pairs(k), 2).transpose(0, 1, 3, 2, 4)
    return np.frombuffer(np.ascontiguousarray(packed).tobytes(), np.uint8)


def integer_conv_scratch_bytes(spec: IntegerConvSpec) -> tuple[int, int, int, int]:
    """(the byte im2col of one image, all groups: 0 for a 1x1 stride-1 unpadded Conv; one group's
    packed panels; the tile; the per-channel scales: 0 without requantisation), in bytes."""
    geo, _, n, k = _dims(spec)
    col = 0 if geo.is_pointwise else geo.in_channels * geo.kernel[0] * geo.kernel[1] * n
    scales = 4 * geo.out_channels if spec.requantize is not None else 0
    return col, panels(n) * pairs(k) * PANEL * 4, TILE_BYTES, scales


def render_integer_conv(spec: IntegerConvSpec, at: IntegerConvOffsets, name: str = "iconv") -> str:
    """`(func $name)` computing `spec` at the offsets `at`, followed by the functions it calls."""
    geo, m, n, k = _dims(spec)
    if spec.x_zero != (at.x_zero is not None) or (spec.requantize is not None) != (at.scales is not None) \
            or spec.bias != (at.bias is not None) or geo.is_pointwise != (at.col is None):
        raise ValueError(f"the offsets {at} do not match {spec}")
    sign = "s" if spec.x_signed else "u"
    size = 4 if spec.requantize is None else 1
    x_image, y_image = geo.in_channels * geo.height * geo.width, geo.out_channels * n * size
    zero = f"(i32.load8_{sign} (i32.const {at.x_zero}))" if spec.x_zero else "(i32.const 0)"
    per_group = [f"(local.set $src (i32.add {'(local.get $xi)' if at.col is None else f'(i32.const {at.col})'}"
                 f" (i32.mul (local.get $grp) (i32.const {k * n}))))",
                 f"(call ${name}_pack (local.get $src) (local.get $za))",
                 f"(local.set $wa (i32.add (i32.const {at.w_packed}) (i32.mul (local.get $grp) "
                 f"(i32.const {groups(m) * pairs(k) * 16}))))",
                 f"(local.set $ch (i32.mul (local.get $grp) (i32.const {m})))",
                 f"(local.set $yc (i32.add (local.get $yi) (i32.mul (local.get $ch) (i32.const {n * size}))))",
                 *_tiles(spec, at, name)]
    per_image = [f"(local.set $xi (i32.add (i32.const {at.x}) (i32.mul (local.get $img) (i32.const {x_image}))))",
                 f"(local.set $yi (i32.add (i32.const {at.y}) (i32.mul (local.get $img) (i32.const {y_image}))))",
                 *([] if at.col is None else [f"(call ${name}_im2col (local.get $xi) (local.get $za))"]),
                 *counted_loop("$grp", geo.groups, per_group)]
    code = [*_scales(spec, at), f"(local.set $za {zero})", *counted_loop("$img", geo.batch, per_image)]
    decls = ("(local $za i32) (local $img i32) (local $grp i32) (local $g i32) (local $p i32) (local $pa i32) "
             "(local $pb i32) (local $pc i32) (local $ps i32) (local $xi i32) (local $yi i32) (local $yc i32) "
             "(local $src i32) (local $wa i32) (local $ch i32) (local $v0 v128) (local $v1 v128)")
    q = spec.requantize
    title = (f";; {'int8' if spec.x_signed else 'uint8'} Conv {geo.in_channels}x{geo.height}x{geo.width} -> "
             f"{geo.out_channels}x{geo.out_height}x{geo.out_width}, kernel {geo.kernel}, groups {geo.groups}, "
             f"batch {geo.batch}: " + (f"requantised to {'int8' if q.signed_output else 'uint8'}" if q else "int32"))
    body = "\n".join([f"(func ${name}", "  " + title, "  " + decls, *("  " + c for c in code), ")"])
    helpers = [render_k_function(f"{name}_k{rows}", rows, at.tile, False) for rows in sorted(tile_heights(m))]
    helpers.append(render_pack_panels(n, k, spec.x_signed, at.b_packed, f"{name}_pack"))
    if at.col is not None:
        helpers.append(_render_im2col(geo, at.col, f"{name}_im2col"))
    return body + "\n" + "".join(helpers)


def _scales(spec: IntegerConvSpec, at: IntegerConvOffsets) -> list[str]:
    """scale[oc] = (x_scale * w_scale[oc]) / y_scale in f32, once per call."""
    q = spec.requantize
    if q is None:
        return []
    index = "(i32.shl (local.get $ch) (i32.const 2))"
    w_scale = f"(f32.load offset={at.w_scale} {index})" if q.b_scale_per_column else f"(f32.load (i32.const {at.w_scale}))"
    value = f"(f32.div (f32.mul (f32.load (i32.const {at.x_scale})) {w_scale}) (f32.load (i32.const {at.y_scale})))"
    return counted_loop("$ch", spec.conv.out_channels, [f"(f32.store offset={at.scales} {index} {value})"])


def _tiles(spec: IntegerConvSpec, at: IntegerConvOffsets, name: str) -> list[str]:
    """One group's product: pixel panels outside (a panel, K x 8 x 2 bytes, stays in L1 while the
    channel groups pass), 4-channel groups inside; the last of either may be partial."""
    _, m, n, k = _dims(spec)
    panel_bytes, group_bytes = pairs(k) * PANEL * 4, pairs(k) * 16
    size = 4 if spec.requantize is None else 1

    def tile(rows: int, cols: int) -> list[str]:
        return [f"(local.set $pa (i32.add (local.get $wa) (i32.mul (local.get $g) (i32.const {group_bytes}))))",
                f"(local.set $pb (i32.add (i32.const {at.b_packed}) (i32.mul (local.get $p) (i32.const {panel_bytes}))))",
                f"(call ${name}_k{rows} (local.get $pa) (local.get $pb) (i32.add (local.get $pb) (i32.const {panel_bytes})))",
                f"(local.set $pc (i32.add (local.get $yc) (i32.add (i32.mul (local.get $g) (i32.const {ROWS * n * size}))"
                f" (i32.mul (local.get $p) (i32.const {PANEL * size})))))",
                "(local.set $ps (i32.shl (i32.add (local.get $ch) (i32.shl (local.get $g) (i32.const 2))) (i32.const 2)))",
                *_epilogue(spec, at, rows, cols, n)]
    return tile_grid(m, n, tile)


def _epilogue(spec: IntegerConvSpec, at: IntegerConvOffsets, rows: int, cols: int, n: int) -> list[str]:
    """The tile's `rows` channels x `cols` pixels from the scratch tile into Y at $pc; $ps is the
    byte offset of the tile's first channel in the per-channel vectors (bias, scales)."""
    q = spec.requantize
    code = []
    if q is None:
        return store_int32_tile(rows, cols, n, lambda r, v: f"(v128.load offset={at.tile + 32 * r + 16 * v} (i32.const 0))")
    info = np.iinfo(np.int8 if q.signed_output else np.uint8)
    lo, hi = float(info.min), float(info.max)
    sign = "s" if q.signed_output else "u"
    zero = f"(f32x4.splat (f32.convert_i32_s (i32.load8_{sign} (i32.const {at.y_zero}))))" if q.out_zero else None
    for r in range(rows):
        for v in range(2):
            value = f"(v128.load offset={at.tile + 32 * r + 16 * v} (i32.const 0))"
            if spec.bias:
                value = f"(i32x4.add {value} (i32x4.splat (i32.load offset={at.bias + 4 * r} (local.get $ps))))"
            value = (f"(f32x4.nearest (f32x4.mul (f32x4.convert_i32x4_s {value}) "
                     f"(f32x4.splat (f32.load offset={at.scales + 4 * r} (local.get $ps)))))")
            if zero is not None:
                value = f"(f32x4.add {value} {zero})"
            code.append(f"(local.set $v{v} (i32x4.trunc_sat_f32x4_s (f32x4.min (f32x4.max {value} "
                        f"(v128.const f32x4 {lo} {lo} {lo} {lo})) (v128.const f32x4 {hi} {hi} {hi} {hi}))))")
        packed = f"(i8x16.narrow_i16x8_{sign} (i16x8.narrow_i32x4_s (local.get $v0) (local.get $v1)) (local.get $v0))"
        if cols == PANEL:
            code.append(f"(v128.store64_lane offset={r * n} 0 (local.get $pc) {packed})")
        else:
            code.append(f"(local.set $v0 {packed})")
            code += [f"(i32.store8 offset={r * n + lane} (local.get $pc) (i8x16.extract_lane_u {lane} (local.get $v0)))"
                     for lane in range(cols)]
    return code


def _render_im2col(geo: Conv2dSpec, dst: int, name: str) -> str:
    """`(func $name (param $src $za))`: col[(c, ky, kx), (oy, ox)] = x[c, oy*sh - pt + ky*dh,
    ox*sw - pl + kx*dw] as bytes at `dst`, za in the padding. For one (c, ky, kx) the columns ox
    inside the image form one range [$lo, $hi), computed once (as kernels/conv.py's im2col); each
    output row is then a fill, a copy (16 bytes per v128 at stride 1), a fill."""
    (kh, kw), (sh, sw), (dh, dw) = geo.kernel, geo.strides, geo.dilations
    pt, pl = geo.pads[0], geo.pads[1]
    h, w, oh, ow, n = geo.height, geo.width, geo.out_height, geo.out_width, geo.pixels
    labels = itertools.count()

    def first_ox(bound: str) -> str:
        """The first ox with ox*sw >= bound (bound may be negative), clamped to [0, ow]."""
        up = f"(i32.div_s (i32.add {bound} (i32.const {sw - 1})) (i32.const {sw}))"
        return (f"(select (i32.const 0) (select (i32.const {ow}) {up} (i32.gt_s {up} (i32.const {ow})))"
                f" (i32.le_s {bound} (i32.const 0)))")

    def run(count: str, vector_step: str | None, byte_step: str, source_stride: int) -> list[str]:
        """$n = count bytes at $q: 16 at a time with `vector_step` (if any), then one at a time."""
        label = next(labels)
        code = [f"(local.set $n {count})"]
        moves = ["(local.set $pa (i32.add (local.get $pa) (i32.const {})))"] if source_stride else []
        if vector_step is not None:
            code += [f"(block $v_done{label} (loop $v{label}",
                     f"  (br_if $v_done{label} (i32.lt_s (local.get $n) (i32.const 16)))",
                     f"  (v128.store (local.get $q) {vector_step})",
                     *("  " + s.format(16 * source_stride) for s in moves),
                     "  (local.set $q (i32.add (local.get $q) (i32.const 16)))",
                     "  (local.set $n (i32.sub (local.get $n) (i32.const 16)))",
                     f"  (br $v{label})))"]
        code += [f"(block $b_done{label} (loop $b{label}",
                 f"  (br_if $b_done{label} (i32.le_s (local.get $n) (i32.const 0)))",
                 f"  (i32.store8 (local.get $q) {byte_step})",
                 *("  " + s.format(source_stride) for s in moves),
                 "  (local.set $q (i32.add (local.get $q) (i32.const 1)))",
                 "  (local.set $n (i32.sub (local.get $n) (i32.const 1)))",
                 f"  (br $b{label})))"]
        return code

    def fill(count: str) -> list[str]:
        return run(count, "(local.get $zv)", "(local.get $za)", 0)

    copy = run("(i32.sub (local.get $hi) (local.get $lo))", "(v128.load (local.get $pa))" if sw == 1 else None,
               "(i32.load8_u (local.get $pa))", sw)
    per_row = [
        f"(local.set $q (i32.add (local.get $row) (i32.mul (local.get $oy) (i32.const {ow}))))",
        f"(local.set $iy (i32.add (i32.sub (i32.mul (local.get $oy) (i32.const {sh})) (i32.const {pt}))"
        f" (i32.mul (local.get $ky) (i32.const {dh}))))",
        # unsigned compare: a negative row (top padding) wraps to a huge one
        f"(if (i32.lt_u (local.get $iy) (i32.const {h}))",
        "  (then",
        f"    (local.set $pa (i32.add (local.get $src) (i32.add (i32.mul (i32.add (i32.mul (local.get $c)"
        f" (i32.const {h})) (local.get $iy)) (i32.const {w})) (i32.add (i32.mul (local.get $lo) (i32.const {sw}))"
        " (local.get $t)))))",
        *("    " + s for s in fill("(local.get $lo)")),
        *("    " + s for s in copy),
        *("    " + s for s in fill(f"(i32.sub (i32.const {ow}) (local.get $hi))")),
        "  )",
        "  (else",
        *("    " + s for s in fill(f"(i32.const {ow})")),
        "  ))"]
    per_tap = [
        f"(local.set $row (i32.add (i32.const {dst}) (i32.mul (i32.add (i32.mul (i32.add (i32.mul (local.get $c)"
        f" (i32.const {kh})) (local.get $ky)) (i32.const {kw})) (local.get $kx)) (i32.const {n}))))",
        # input column of ox is ox*sw + $t: inside the image for ox in [$lo, $hi)
        f"(local.set $t (i32.sub (i32.mul (local.get $kx) (i32.const {dw})) (i32.const {pl})))",
        f"(local.set $lo {first_ox('(i32.sub (i32.const 0) (local.get $t))')})",
        f"(local.set $hi {first_ox(f'(i32.sub (i32.const {w}) (local.get $t))')})",
        "(local.set $hi (select (local.get $hi) (local.get $lo) (i32.gt_s (local.get $hi) (local.get $lo))))",
        *counted_loop("$oy", oh, per_row)]
    body = counted_loop("$c", geo.in_channels, counted_loop("$ky", kh, counted_loop("$kx", kw, per_tap)))
    lines = [f"(func ${name} (param $src i32) (param $za i32)",
             f"  ;; byte im2col of {geo.in_channels}x{h}x{w} for a {kh}x{kw} kernel, {oh}x{ow} pixels",
             "  (local $c i32) (local $ky i32) (local $kx i32) (local $oy i32) (local $iy i32) (local $row i32)",
             "  (local $t i32) (local $lo i32) (local $hi i32) (local $q i32) (local $pa i32) (local $n i32) (local $zv v128)",
             "  (local.set $zv (i8x16.splat (local.get $za)))", *("  " + s for s in body), ")"]
    return "\n".join(lines) + "\n"
