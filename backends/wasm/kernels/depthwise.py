"""Depthwise Conv2D (one input and one output channel per group) computed directly, without im2col.

As im2col + GEMM, a depthwise 3x3 Conv is a product with one row (M = 1) and K = 9 per channel, after
writing every input pixel nine times into the panels: in ShuffleNet that packing was 40% of the
model's time. Here each channel is copied once into a zero-bordered plane in the scratch (so the
taps need no bounds checks), and four adjacent output pixels are one v128 accumulator that takes
one multiply-add per tap from an unaligned load of the plane (stride 2: two loads and a shuffle of
the even lanes; larger strides: lane by lane). The tap weights of the channel live in locals.

Entry points
- `is_depthwise(spec)`: whether `render_depthwise` applies (groups == in channels == out channels).
- `depthwise_scratch_bytes(spec)`: the zero-bordered plane.
- `render_depthwise(spec, at, *, epilogue=None, features, name)`: a `(func $name)` computing
  Y = epilogue(conv(X, W) + bias + residual) for every image, with scalar f32 code without "simd".
"""

from __future__ import annotations

from backends.wasm.kernels.activation import f32_activation, scratch_locals, v128_activation
from backends.wasm.kernels.operands import ConvOffsets

MAX_WEIGHT_LOCALS = 25  # taps kept in locals (5x5); larger kernels load their weights per use


def is_depthwise(spec) -> bool:
    return spec.groups == spec.in_channels == spec.out_channels and spec.groups > 1


def _plane(spec, lanes: int) -> tuple[int, int]:
    """(rows, row length) of the zero-bordered plane: wide enough that the last vector of a row
    may read its whole span (the lanes past the output width are computed and not stored)."""
    kw, sw, dw = spec.kernel[1], spec.strides[1], spec.dilations[1]
    pt, pl, pb, pr = spec.pads
    vectors = -(-spec.out_width // lanes)
    span = 1 if lanes == 1 else (4 if sw == 1 else 8 if sw == 2 else 3 * sw + 1)
    width = max(spec.width + pl + pr, (vectors - 1) * lanes * sw + (kw - 1) * dw + span)
    return spec.height + pt + pb, width


def depthwise_scratch_bytes(spec) -> int:
    # Sized for the SIMD layout, which is never smaller than the scalar one.
    rows, width = _plane(spec, 4)
    return rows * width * 4


def render_depthwise(spec, at: ConvOffsets, *, epilogue: str | None = None, features=frozenset({"simd"}),
                     name: str = "conv") -> str:
    x_offset, w_offset, y_offset, scratch_offset, bias_offset, residual_offset = (
        at.x, at.w, at.y, at.scratch, at.bias, at.residual)
    simd = "simd" in features
    fma = "relaxed-simd" in features
    lanes = 4 if simd else 1
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel, spec.strides, spec.dilations
    pt, pl = spec.pads[0], spec.pads[1]
    h, w, oh, ow = spec.height, spec.width, spec.out_height, spec.out_width
    rows, width = _plane(spec, lanes)
    channels, taps = spec.in_channels, kh * kw
    plane = scratch_offset
    vt = "v128" if simd else "f32"
    hoisted = taps <= MAX_WEIGHT_LOCALS

    def splat(value: str) -> str:
        return f"(f32x4.splat {value})" if simd else value

    def weight(t: int) -> str:
        return f"(local.get $w{t})" if hoisted else splat(f"(f32.load offset={4 * t} (local.get $pw))")

    def madd(a: str, b: str, c: str) -> str:
        if not simd:
            return f"(f32.add (f32.mul {a} {b}) {c})"
        return f"(f32x4.relaxed_madd {a} {b} {c})" if fma else f"(f32x4.add (f32x4.mul {a} {b}) {c})"

    def tap_input(offset: int) -> str:
        """The plane values under one tap for the `lanes` outputs at $pin (+ offset bytes)."""
        if not simd:
            return f"(f32.load offset={offset} (local.get $pin))"
        if sw == 1:
            return f"(v128.load offset={offset} (local.get $pin))"
        if sw == 2:
            return (f"(i8x16.shuffle 0 1 2 3 8 9 10 11 16 17 18 19 24 25 26 27 (v128.load offset={offset} (local.get $pin))"
                    f" (v128.load offset={offset + 16} (local.get $pin)))")
        value = f"(f32x4.splat (f32.load offset={offset} (local.get $pin)))"
        for lane in range(1, 4):
            value = f"(f32x4.replace_lane {lane} {value} (f32.load offset={offset + 4 * lane * sw} (local.get $pin)))"
        return value

    # -- zero the plane once: the interior is overwritten per channel, the border stays zero
    total = rows * width * 4
    zero = ["(local.set $p (i32.const 0))",
            "(loop $zero",
            f"  (f32.store offset={plane} (local.get $p) (f32.const 0))",
            "  (local.set $p (i32.add (local.get $p) (i32.const 4)))",
            f"  (br_if $zero (i32.lt_u (local.get $p) (i32.const {total}))))"]
    # -- copy channel $c of image $n (at $px) into the plane's interior, row by row
    copy_vec, copy_tail = divmod(w, 4) if simd else (0, w)
    row_copy = []
    if copy_vec:
        row_copy += [f"(v128.store offset={16 * i} (local.get $pin) (v128.load offset={16 * i} (local.get $pa)))"
                     for i in range(copy_vec)]
    row_copy += [f"(f32.store offset={16 * copy_vec + 4 * i} (local.get $pin) (f32.load offset={16 * copy_vec + 4 * i} (local.get $pa)))"
                 for i in range(copy_tail)]
    copy = ["(local.set $pa (local.get $px))",
            f"(local.set $pin (i32.const {plane + (pt * width + pl) * 4}))",
            f"(local.set $pend (i32.add (local.get $pin) (i32.const {h * width * 4})))",
            "(loop $copy",
            *("  " + s for s in row_copy),
            f"  (local.set $pa (i32.add (local.get $pa) (i32.const {w * 4})))",
            f"  (local.set $pin (i32.add (local.get $pin) (i32.const {width * 4})))",
            "  (br_if $copy (i32.lt_u (local.get $pin) (local.get $pend))))"]
    # -- the tap weights of channel $c
    load_weights = [f"(local.set $w{t} {splat(f'(f32.load offset={4 * t} (local.get $pw))')})" for t in range(taps)] if hoisted else []
    # -- one output vector at $pin (plane) / $py (output) / $pr (residual)
    if bias_offset is not None:
        init = splat(f"(f32.load offset={bias_offset} (i32.shl (local.get $c) (i32.const 2)))")
    else:
        init = "(v128.const f32x4 0 0 0 0)" if simd else "(f32.const 0)"
    body = [f"(local.set $acc {init})"]
    for ky in range(kh):
        for kx in range(kw):
            offset = (ky * dh * width + kx * dw) * 4
            body.append(f"(local.set $acc {madd(weight(ky * kw + kx), tap_input(offset), '(local.get $acc)')})")

    def finish(count: int) -> list[str]:
        """Residual, activation and the store of the first `count` lanes."""
        code = []
        if residual_offset is not None:
            res = _load("$pr", count, simd)
            code.append(f"(local.set $acc ({'f32x4' if simd else 'f32'}.add (local.get $acc) {res}))")
        code += v128_activation(epilogue, "$acc") if simd else f32_activation(epilogue, "$acc")
        return code + _store("$py", count, simd)

    full, tail = divmod(ow, lanes)

    def step(count: int) -> list[str]:
        return [f"(local.set $pin (i32.add (local.get $pin) (i32.const {lanes * sw * 4})))",
                f"(local.set $py (i32.add (local.get $py) (i32.const {count * 4})))",
                f"(local.set $pr (i32.add (local.get $pr) (i32.const {count * 4})))"]
    row = [f"(local.set $pin (i32.add (i32.const {plane}) (i32.mul (local.get $oy) (i32.const {sh * width * 4}))))"]
    if full:
        row += [f"(local.set $pend (i32.add (local.get $py) (i32.const {full * lanes * 4})))",
                "(loop $ox", *("  " + s for s in body + finish(lanes) + step(lanes)),
                "  (br_if $ox (i32.lt_u (local.get $py) (local.get $pend))))"]
    if tail:
        row += body + finish(tail) + step(tail)
    rows_loop = ["(local.set $oy (i32.const 0))",
                 "(loop $oy", *("  " + s for s in row),
                 "  (local.set $oy (i32.add (local.get $oy) (i32.const 1)))",
                 f"  (br_if $oy (i32.lt_u (local.get $oy) (i32.const {oh}))))"]
    channel = [*copy, *load_weights, *rows_loop,
               f"(local.set $px (i32.add (local.get $px) (i32.const {h * w * 4})))",
               f"(local.set $pw (i32.add (local.get $pw) (i32.const {taps * 4})))"]
    images = [f"(local.set $px (i32.const {x_offset}))",
              f"(local.set $py (i32.const {y_offset}))",
              f"(local.set $pr (i32.const {residual_offset or 0}))",
              "(local.set $n (i32.const 0))",
              "(loop $image",
              f"  (local.set $pw (i32.const {w_offset}))",
              "  (local.set $c (i32.const 0))",
              "  (loop $channel", *("    " + s for s in channel),
              "    (local.set $c (i32.add (local.get $c) (i32.const 1)))",
              f"    (br_if $channel (i32.lt_u (local.get $c) (i32.const {channels}))))",
              "  (local.set $n (i32.add (local.get $n) (i32.const 1)))",
              f"  (br_if $image (i32.lt_u (local.get $n) (i32.const {spec.batch}))))"]
    decls = ["(local $n i32) (local $c i32) (local $oy i32) (local $p i32) (local $px i32) (local $pw i32)",
             "(local $pa i32) (local $pin i32) (local $py i32) (local $pr i32) (local $pend i32)",
             f"(local $acc {vt})"]
    if hoisted:
        decls.append(" ".join(f"(local $w{t} {vt})" for t in range(taps)))
    decls += scratch_locals("v128" if simd else "f32")
    title = (f";; depthwise Conv {channels}x{h}x{w} -> {oh}x{ow}, kernel {spec.kernel}, strides {spec.strides}, "
             f"batch {spec.batch}: direct, {lanes} output pixel{'s' if lanes > 1 else ''} per step")
    code = zero + images
    return "\n".join([f"(func ${name}", "  " + title, *("  " + d for d in decls), *("  " + c for c in code), ")"]) + "\n"


def _load(ptr: str, count: int, simd: bool) -> str:
    if not simd:
        return f"(f32.load (local.get {ptr}))"
    if count == 4:
        return f"(v128.load (local.get {ptr}))"
    value = "(v128.const f32x4 0 0 0 0)"
    for lane in range(count):  # never read past the last output pixel of the row
        value = f"(f32x4.replace_lane {lane} {value} (f32.load offset={4 * lane} (local.get {ptr})))"
    return value


def _store(ptr: str, count: int, simd: bool) -> list[str]:
    if not simd:
        return [f"(f32.store (local.get {ptr}) (local.get $acc))"]
    if count == 4:
        return [f"(v128.store (local.get {ptr}) (local.get $acc))"]
    return [f"(f32.store offset={4 * lane} (local.get {ptr}) (f32x4.extract_lane {lane} (local.get $acc)))"
            for lane in range(count)]
