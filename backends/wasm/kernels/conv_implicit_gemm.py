"""Conv2D as an implicit GEMM over output pixels: Y^T[p, oc] = X-window[p, k] @ W[k, oc], no im2col.

The other orientation of `kernels/conv.py`. There the weight is A and the im2col matrix (9 x the
input for a 3x3 kernel, packed at run time) is B; when the Conv has few output channels, packing B
costs as much as the product. Here the roles swap:
- B is the weight, packed at compile time (`pack_implicit_gemm_weight`) into 16-output-channel
  panels with k ordered (ky, kx, c);
- A is the input itself, read in place by the micro-kernel's broadcast loads: for one (ky, kx) and a
  block of up to 128 input channels, A[p, c] sits at `x + c*plane + (iy*width + ix)*4`, so the tile's
  k step is one channel plane and its row step (the next output pixel) is `stride*4` bytes. A Conv
  with padding first copies its input into a zero-bordered scratch (about the input's size);
- C is a pixel-major scratch Y^T [pixels x channels] (channels rounded up to 4), which one
  vectorised pass (4x4 blocks transposed with `i8x16.shuffle`) turns into the NCHW output. The bias
  (per output channel = per column) and the activation run in the tile's epilogue; a residual is
  NCHW, so with one the transpose pass adds it and applies the activation.

A K block is one (ky, kx, channel block); `$first` / `$last` mark the first and last of them. With
stride 1, output pixel (oy, ox) reads the input at (oy*Wp + ox) + (ky*Wp + kx) in a plane of width
Wp (padded), so the pixels run as one line q = oy*Wp + ox over the whole plane, tiles of 4 straight
across rows: the kw - 1 columns past each row's end are computed and never read back, which costs
less than the 1-3 pixel tiles at every row's end that strided Convs need (they tile row by row).
Loops, outermost first: groups of pixels (`Y_CHUNK_BYTES` of Y^T), K blocks, 16-channel panels, tiles
of 4 pixels x 16 channels (the GEMM's 4 x 16 register tile) along the group's rows.

Groups > 1 stay on im2col (depthwise on `kernels/depthwise.py`); SIMD is required (the scalar build
keeps im2col). Which orientation a Conv takes is `implicit_gemm_is_faster` (the rule and its
measurements are in its docstring).

Entry points
- `implicit_gemm_is_faster(spec, features) -> bool`: the rule; `can_run_as_implicit_gemm` what is possible.
- `pack_implicit_gemm_weight(spec, w) -> np.ndarray`: the weight as this kernel reads it.
- `implicit_gemm_scratch_bytes(spec) -> int`
- `render_conv2d_implicit_gemm(spec, at, *, epilogue=None, features=SIMD_FMA, name="conv") -> str`:
  WAT functions at the offsets `at` (`ConvOffsets`), the one to call being `$name`.
"""

from __future__ import annotations

import numpy as np

from backends.wasm.gemm import SIMD_FMA, _k_function_unroll, pack_b
from backends.wasm.kernels.activation import check_epilogue, f32_activation, scratch_locals, v128_activation
from backends.wasm.kernels.microkernel import (PANEL, PANEL_BYTES, UNROLL, TileGeometry, Vec, edge_pass_lanes,
                                               render_k_functions, render_tile, tile_locals)
from backends.wasm.kernels.operands import ConvOffsets
from backends.wasm.kernels.wat_loops import wat_function
from backends.wasm.simd_lanes import shuffle_lanes

K_BLOCK = 128   # input channels per K block: one panel's block of B is 8 KiB, as in the GEMM
TILE_PIXELS = 4
# Pixels per group: every K block passes over the group's rows of Y^T (pixels x channels) before the
# next group, so that block stays in L2 instead of streaming through memory once per K block; but
# each group reads all of B again, so groups must not be small either. Measured (the product alone,
# CPU time, GFLOP/s; Y^T whole / 1 MiB / 256 KiB / 64 KiB groups): vgg19's 3x3 64->64 at 224x224
# (12.8 MB of Y^T) 13.7 / 34.2 / 36.8 / 38.0; 128->128 at 112x112 35.2 / 35.3 / 38.5 / 38.7; its
# 512->512 at 28x28 (9.4 MB of B) 33.7 / 33.5 / 34.6 / 26.7; densenet121's 128->32 at 56x56
# 26.7 / 30.6 / 35.2 / 35.8.
Y_CHUNK_BYTES = 256 << 10


def can_run_as_implicit_gemm(spec, features) -> bool:
    return "simd" in frozenset(features) and spec.groups == 1


def implicit_gemm_is_faster(spec, features) -> bool:
    """The rule that picks this orientation over im2col: few output channels, stride 1.

    Measured by timing both orientations on every Conv shape of densenet121, resnet50, squeezenet,
    vgg19, inception_v1, bvlc_alexnet and zfnet512 (165 shapes with one group), each compiled alone
    into a module (wasmtime 50, relaxed SIMD, pixel groups of 256 KiB, CPU time, median of
    interleaved runs, on a machine shared with other work: ratios within about 0.1 of 1 move between
    runs), then the doubtful classes again as one-Conv models through the whole compiler
    (`cortex.load`, CPU time of the CU). Implicit / im2col time:
    - few output channels is where it wins, the im2col packing costing as much as a product with
      small M: densenet121's 3x3 128->32 at 56x56 0.56 (12.7 ms -> 35.7 GFLOP/s; through the
      compiler 10.8 -> 7.3 ms), 28x28 0.65, 14x14 0.72, 7x7 0.70; resnet50's 3x3 64->64 at 56x56
      0.74; vgg19's 64->64 at 224x224 0.74 (compiler: 122.7 -> 101.8 ms); squeezenet's squeeze 1x1s
      0.62-0.86 (compiler, 64->16 at 55x55: 0.61) and its 3x3 16->64 0.67; inception_v1's 1x1s to
      16-64 channels 0.49-0.80 (compiler, 480->64 at 13x13: 0.87), its 5x5 16->32 0.80;
    - with 128-256 output channels the single modules still show gains on large planes (vgg19's
      3x3s at 56x56-112x112 0.81-0.86) and for 1x1s on small images (0.68-1.07), but through the
      compiler those are ties or losses (1x1 512->128 at 14x14 1.03, 832->256 at 7x7 1.01,
      1024->256 at 14x14 1.09-1.14; resnet50's and vgg19's CUs holding them 1.00-1.04), so they
      stay on im2col; so does anything wider (vgg19's 512-channel 3x3s 1.07-1.28);
    - on small planes the kw - 1 columns computed past each row's end cost: 5x5s to 64 channels on
      13x13 (4 of every 17 columns) 0.97-1.01, so past a fifth of the work only 32 channels or
      fewer take this orientation;
    - a 1x1 to 64 channels on a large image wins only as a squeeze (at most half the input's
      channels): resnet50's 256->64 at 56x56 0.92, but 64->64 1.03-1.08, 16->64 0.98;
    - strided Convs tie or lose (3x3 stride 2: 0.95-1.12, 1x1 stride 2: 1.14-1.35), and so do Convs
      of 3 input channels (vgg19's first 1.61, the 7x7 stems 1.36-1.38), one K block per channel.
    Whole light models compiled with this rule against im2col only (opt-level 3, relaxed SIMD, CPU
    time of a run, median of 10 interleaved runs, vgg19 4): densenet121 194.0 -> 168.2 ms,
    squeezenet 23.2 -> 22.3, inception_v1 82.8 -> 81.0, resnet50 214.9 -> 212.1, vgg19 992 -> 968.
    Since im2col runs in chunks of output rows on large outputs (`conv.im2col_chunk_rows`), vgg19's
    64->64 at 224x224 ties (min of 7 interleaved rounds: implicit 90.5 ms, im2col 90.0); 64->64 and
    128->32 at 56x56 still favour this orientation (7.0 vs 8.3 ms, 6.2 vs 8.6 ms)."""
    if not can_run_as_implicit_gemm(spec, features) or spec.strides != (1, 1) or spec.in_channels < 16:
        return False
    oc = spec.out_channels
    if spec.kernel == (1, 1):
        return oc <= 64 and (spec.pixels <= 27 * 27 or spec.in_channels >= 2 * oc)
    wasted = (spec.kernel[1] - 1) * spec.dilations[1] / _plane(spec)[1]  # of each line row
    return oc <= 32 or (oc <= 64 and wasted <= 0.2)


def pack_implicit_gemm_weight(spec, w: np.ndarray) -> np.ndarray:
    """W [OC, C, kh, kw] as B [k = (ky, kx, c), oc] in 16-column panels."""
    w = np.asarray(w, dtype=np.float32).reshape(spec.out_channels, spec.in_channels, *spec.kernel)
    b = w.transpose(2, 3, 1, 0).reshape(-1, spec.out_channels)
    return np.frombuffer(pack_b(b), dtype="<f4")


def _padded(spec) -> bool:
    return any(spec.pads)


def _plane(spec) -> tuple[int, int]:
    """Height and width of the plane the tiles read: the input, or its zero-bordered copy."""
    pt, pl, pb, pr = spec.pads
    return spec.height + pt + pb, spec.width + pl + pr


def _line_width(spec) -> int:
    """Pixels per output row in Y^T: the plane's width when pixels run as one line (stride 1)."""
    return _plane(spec)[1] if spec.strides == (1, 1) else spec.out_width


def _channels_padded(spec) -> int:
    return -(-spec.out_channels // 4) * 4


def _yt_pixels(spec) -> int:
    return (spec.out_height - 1) * _line_width(spec) + spec.out_width


def implicit_gemm_scratch_bytes(spec) -> int:
    """The zero-bordered input (with padding), then Y^T."""
    hp, wp = _plane(spec)
    pad_bytes = spec.in_channels * hp * wp * 4 if _padded(spec) else 0
    return pad_bytes + _yt_pixels(spec) * _channels_padded(spec) * 4


def render_conv2d_implicit_gemm(spec, at: ConvOffsets, *, epilogue: str | None = None, features=SIMD_FMA,
                                name: str = "conv") -> str:
    x_offset, w_offset, y_offset, scratch_offset, bias_offset, residual_offset = (
        at.x, at.w, at.y, at.scratch, at.bias, at.residual)
    check_epilogue(epilogue)
    if not can_run_as_implicit_gemm(spec, features):
        raise ValueError(f"Conv {spec} cannot run as an implicit GEMM with features {sorted(features)}")
    hp, wp = _plane(spec)
    x_image = spec.in_channels * spec.height * spec.width * 4
    y_image = spec.out_channels * spec.pixels * 4
    padded_at = scratch_offset
    yt_at = scratch_offset + (spec.in_channels * hp * wp * 4 if _padded(spec) else 0)
    # The tiles' k functions depend only on the geometry, the same for every image.
    product_epilogue = None if residual_offset is not None else epilogue
    fma = "relaxed-simd" in frozenset(features)
    geometry = _tile_geometry(spec, bias_offset is not None, product_epilogue, fma)
    k_function, k_functions = _render_k_functions(spec, geometry, f"{name}_k")
    funcs, calls = [k_functions], []
    for image in range(spec.batch):  # each image gets its own functions: every offset stays a constant
        x, y = x_offset + image * x_image, y_offset + image * y_image
        res = None if residual_offset is None else residual_offset + image * y_image
        if _padded(spec):
            funcs.append(_render_pad(spec, x, padded_at, f"{name}_pad_{image}"))
            calls.append(f"  (call ${name}_pad_{image})")
            x = padded_at
        funcs.append(_render_product(spec, x, w_offset, yt_at, bias_offset, (geometry, k_function),
                                     f"{name}_gemm_{image}"))
        funcs.append(_render_transpose(spec, yt_at, y, res, epilogue if res is not None else None,
                                       f"{name}_out_{image}"))
        calls += [f"  (call ${name}_gemm_{image})", f"  (call ${name}_out_{image})"]
    title = (f"  ;; Conv {spec.in_channels}x{spec.height}x{spec.width} -> {spec.out_channels}x{spec.out_height}x"
             f"{spec.out_width}, kernel {spec.kernel}, batch {spec.batch}: implicit GEMM over pixels")
    return "".join(funcs) + "\n".join([f"(func ${name}", title, *calls, ")"]) + "\n"


def _func(name: str, title: str, decls: list[str], code: list[str]) -> str:
    return wat_function(name, ";; " + title, decls, code)


def _loop(var: str, start: int, stop: int, step: int, body: list[str]) -> list[str]:
    """for var in range(start, stop, step); nothing when empty, no loop when it runs once."""
    count = max(0, -(-(stop - start) // step))
    if count == 0:
        return []
    if count == 1:
        return [f"(local.set {var} (i32.const {start}))", *body]
    label = var.replace("$", "$l_")
    return [f"(local.set {var} (i32.const {start}))", f"(loop {label}", *("  " + b for b in body),
            f"  (local.set {var} (i32.add (local.get {var}) (i32.const {step})))",
            f"  (br_if {label} (i32.lt_u (local.get {var}) (i32.const {stop}))))"]


def _render_pad(spec, src: int, dst: int, name: str) -> str:
    """dst[c][iy + pt][ix + pl] = x[c][iy][ix], zeros around: rows of the plane are written in
    order, so the top/bottom borders and the left/right border pairs between rows are each one run
    of zeros."""
    hp, wp = _plane(spec)
    pt, pl, _, _ = spec.pads
    h, w = spec.height, spec.width
    plane = hp * wp * 4

    def zeros(start: str, count_bytes: str) -> list[str]:
        return ["(local.set $p " + start + ")", f"(local.set $end (i32.add (local.get $p) {count_bytes}))",
                "(block $z_done (loop $z",
                "  (br_if $z_done (i32.ge_u (local.get $p) (local.get $end)))",
                "  (f32.store (local.get $p) (f32.const 0))",
                "  (local.set $p (i32.add (local.get $p) (i32.const 4)))",
                "  (br $z)))"]

    vec_end = (w // 4) * 16
    copy_row = [
        # one input row: 4 floats at a time, then the rest
        "(local.set $s (i32.add (i32.const %d) (i32.mul (i32.add (i32.mul (local.get $c) (i32.const %d)) (local.get $iy)) (i32.const %d))))"
        % (src, h, w * 4),
        f"(local.set $p (i32.add (i32.const {dst}) (i32.add (i32.mul (local.get $c) (i32.const {plane}))"
        f" (i32.mul (i32.add (local.get $iy) (i32.const {pt})) (i32.const {wp * 4})))))",
        *zeros("(local.get $p)", f"(i32.const {pl * 4})"),
        *_loop("$i", 0, vec_end, 16, [
            "(v128.store (i32.add (local.get $p) (local.get $i)) (v128.load (i32.add (local.get $s) (local.get $i))))"]),
        *_loop("$i", vec_end, w * 4, 4, [
            "(f32.store (i32.add (local.get $p) (local.get $i)) (f32.load (i32.add (local.get $s) (local.get $i))))"]),
        *zeros(f"(i32.add (local.get $p) (i32.const {w * 4}))", f"(i32.const {(wp - w - pl) * 4})"),
    ]
    plane_at = f"(i32.add (i32.const {dst}) (i32.mul (local.get $c) (i32.const {plane})))"
    body = [
        *zeros(plane_at, f"(i32.const {pt * wp * 4})"),
        *_loop("$iy", 0, h, 1, copy_row),
        *zeros(f"(i32.add {plane_at} (i32.const {(pt + h) * wp * 4}))", f"(i32.const {(hp - pt - h) * wp * 4})"),
    ]
    decls = ["(local $c i32) (local $iy i32) (local $i i32) (local $s i32) (local $p i32) (local $end i32)"]
    return _func(name, f"zero-bordered copy of {spec.in_channels}x{h}x{w} into planes of {hp}x{wp}", decls,
                 _loop("$c", 0, spec.in_channels, 1, body))


def _tile_geometry(spec, has_bias: bool, epilogue: str | None, fma: bool) -> TileGeometry:
    kh, kw = spec.kernel
    hp, wp = _plane(spec)
    blocks = kh * kw * -(-spec.in_channels // K_BLOCK)
    return TileGeometry(k=spec.in_channels * kh * kw, a_k_step=hp * wp * 4, a_row_step=spec.strides[1] * 4,
                        c_row_step=_channels_padded(spec) * 4, has_bias=has_bias, bias_per_row=False,
                        has_residual=False, epilogue=epilogue, fma=fma, static_first=True if blocks == 1 else None,
                        static_last=True if blocks == 1 else None)


def _render_k_functions(spec, geometry: TileGeometry, name: str) -> tuple[str | None, str]:
    """The k-loop functions the tiles call, and their name (None: the tiles keep the loop inline).

    With relaxed SIMD the 4-pixel passes call the GEMM's k functions (unrolled, no spills; see
    `gemm._k_function_unroll`): their A is 4 pixels 4 bytes apart, one v128 per k step, as packed A
    in the GEMM. Stride 1 only: strided tiles read pixels `stride*4` bytes apart. Measured (Conv +
    bias + relu as one module, wasmtime 50, relaxed SIMD, CPU time of the call, median of 7
    interleaved rounds, GFLOP/s, inline loop -> function): resnet50's 3x3 64->64 at 56x56
    37.0 -> 42.5, densenet121's 3x3 128->32 at 56x56 36.7 -> 39.5, 1x1 256->64 at 56x56 37.3 -> 41.3."""
    unroll = _k_function_unroll(geometry.fma) if spec.strides[1] == 1 else None
    if unroll is None:
        return None, ""
    edge = spec.out_channels % PANEL
    return name, render_k_functions(name, geometry, unroll, edge_pass_lanes(edge) if edge else [])


def _grouping(spec, parts: int = 1) -> tuple[int, int, int, int, int]:
    """How the product walks Y^T: (pixels a row, the last row's pixels where shorter (else 0), rows,
    bytes from one row's input to the next, rows a group). Pixels go in groups whose block of Y^T
    stays in cache while every K block passes over it; cut into `parts` parts, a group is at most
    a part's share of them, so that each part has groups of its own (`product_groups`)."""
    (sh, _), (_, wp) = spec.strides, _plane(spec)
    c_row = _channels_padded(spec) * 4
    chunk = max(TILE_PIXELS, Y_CHUNK_BYTES // c_row // TILE_PIXELS * TILE_PIXELS)
    if spec.strides == (1, 1):  # one line of pixels over the whole plane, cut into rows of `chunk`
        pixels = _yt_pixels(spec)
        if parts > 1:
            chunk = min(chunk, -(-pixels // parts // TILE_PIXELS) * TILE_PIXELS or TILE_PIXELS)
        row_len = min(chunk, pixels)
        return row_len, pixels % row_len, -(-pixels // row_len), row_len * 4, 1
    rows = spec.out_height
    group_rows = max(1, min(rows, chunk // spec.out_width))
    if parts > 1:
        group_rows = min(group_rows, -(-rows // parts))
    return spec.out_width, 0, rows, sh * wp * 4, group_rows


def product_groups(spec, parts: int) -> int:
    """The groups of pixels the product runs in when cut into `parts` parts (a shorter last one counted)."""
    _, last_len, rows, _, group_rows = _grouping(spec, parts)
    if last_len:
        return rows
    return -(-rows // group_rows)


def render_conv2d_implicit_gemm_parts(spec, at: ConvOffsets, bounds, *, epilogue: str | None = None,
                                      features=SIMD_FMA, name: str = "conv") -> tuple[str, list]:
    """The implicit GEMM as parts (backends/wasm/kernel_parts.py): per image, the zero border (one
    thread), then the product's groups of pixels `bounds[p]` (`product_groups(spec, len(bounds))`),
    then the transpose into NCHW by blocks of output rows. Returns the functions and the steps
    (the serial function to call first or None, the parts' names)."""
    check_epilogue(epilogue)
    parts = len(bounds)
    hp, wp = _plane(spec)
    x_image = spec.in_channels * spec.height * spec.width * 4
    y_image = spec.out_channels * spec.pixels * 4
    yt_at = at.scratch + (spec.in_channels * hp * wp * 4 if _padded(spec) else 0)
    product_epilogue = None if at.residual is not None else epilogue
    geometry = _tile_geometry(spec, at.bias is not None, product_epilogue, "relaxed-simd" in frozenset(features))
    k_function, k_functions = _render_k_functions(spec, geometry, f"{name}_k")
    funcs, steps = [k_functions], []
    out_rows = [(spec.out_height * p // parts, spec.out_height * (p + 1) // parts) for p in range(parts)]
    for image in range(spec.batch):
        x, y = at.x + image * x_image, at.y + image * y_image
        res = None if at.residual is None else at.residual + image * y_image
        pad = None
        if _padded(spec):
            pad = f"{name}_pad_{image}"
            funcs.append(_render_pad(spec, x, at.scratch, pad))
            x = at.scratch
        products, transposes = [], []
        for p, groups in enumerate(bounds):
            products.append(f"{name}_gemm_{image}_part{p}")
            funcs.append(_render_product(spec, x, at.w, yt_at, at.bias, (geometry, k_function), products[-1],
                                         groups=(*groups, parts)))
        for p, rows in enumerate(out_rows):
            if rows[1] > rows[0]:
                transposes.append(f"{name}_out_{image}_part{p}")
                funcs.append(_render_transpose(spec, yt_at, y, res, epilogue if res is not None else None,
                                               transposes[-1], rows=rows))
        steps += [(pad, products), (None, transposes)]
    return "".join(funcs), steps


def _render_product(spec, x: int, w: int, yt: int, bias: int | None, tiles: tuple[TileGeometry, str | None],
                    name: str, groups: tuple[int, int, int] | None = None) -> str:
    """Y^T = X-windows @ B (+ bias, then the activation when there is no residual), the tiles as
    `tiles` = (geometry, k function) says (`_tile_geometry`; with a k function, see
    `_render_k_functions`, the tiles call it for their k loops). With `groups` (start, stop, parts), only those groups of pixels, grouped
    as for `parts` parts (`_grouping`)."""
    geometry, k_function = tiles
    epilogue = geometry.epilogue
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel, spec.strides, spec.dilations
    hp, wp = _plane(spec)
    c_in, oc = spec.in_channels, spec.out_channels
    k_total = c_in * kh * kw
    plane = hp * wp * 4
    c_blocks = -(-c_in // K_BLOCK)
    blocks = kh * kw * c_blocks
    line = _line_width(spec)
    c_row = _channels_padded(spec) * 4
    row_len, last_len, rows, in_row_step, group_rows = _grouping(spec, groups[2] if groups is not None else 1)
    def tile(pixels: int, vecs: list[Vec]) -> list[str]:
        return [
            "(local.set $pa (i32.add (local.get $arow) (i32.mul (local.get $ox) (i32.const %d))))" % (sw * 4),
            "(local.set $pc (i32.add (local.get $crow) (i32.mul (local.get $ox) (i32.const %d))))" % c_row,
            "(local.set $pb (local.get $bblock))",
            "(local.set $pend (local.get $bend))",
            "(local.set $pend4 (local.get $bend4))",
            *render_tile(pixels, vecs, geometry, k_function),
        ]

    def panel(vecs: list[Vec], n_rows: int, length: int) -> list[str]:
        """Panel $j of K block $kb for rows $oy0 .. $oy0 + n_rows of `length` pixels each."""
        full, rest = divmod(length, TILE_PIXELS)
        row = [
            f"(local.set $arow (i32.add (local.get $abase) (i32.mul (local.get $oy) (i32.const {in_row_step}))))",
            f"(local.set $crow (i32.add (i32.const {yt}) (i32.add (i32.mul (local.get $oy) (i32.const {row_len * c_row}))"
            f" (i32.mul (local.get $j) (i32.const {PANEL_BYTES})))))",
            *_loop("$ox", 0, full * TILE_PIXELS, TILE_PIXELS, tile(TILE_PIXELS, vecs)),
        ]
        if rest:
            row += [f"(local.set $ox (i32.const {full * TILE_PIXELS}))", *tile(rest, vecs)]
        code = [
            f"(local.set $bblock (i32.add (i32.const {w}) (i32.mul (i32.add (i32.mul (local.get $j) (i32.const {k_total}))"
            f" (local.get $k0)) (i32.const {PANEL_BYTES}))))",
            f"(local.set $bend (i32.add (local.get $bblock) (i32.mul (local.get $klen) (i32.const {PANEL_BYTES}))))",
            f"(local.set $bend4 (i32.add (local.get $bblock) (i32.mul (i32.and (local.get $klen) (i32.const {-UNROLL}))"
            f" (i32.const {PANEL_BYTES}))))",
            f"(local.set $pbias (i32.add (i32.const {bias or 0}) (i32.mul (local.get $j) (i32.const {PANEL_BYTES}))))",
            "(local.set $oy (local.get $oy0))",
        ]
        if n_rows == 1:
            return code + row
        return code + [
            f"(local.set $oyend (i32.add (local.get $oy0) (i32.const {n_rows})))",
            "(loop $l_oy", *("  " + r for r in row),
            "  (local.set $oy (i32.add (local.get $oy) (i32.const 1)))",
            "  (br_if $l_oy (i32.lt_u (local.get $oy) (local.get $oyend))))",
        ]

    def group(n_rows: int, length: int) -> list[str]:
        """Every K block, every panel, over rows $oy0 .. $oy0 + n_rows."""
        full_panels, edge = divmod(oc, PANEL)
        panels = _loop("$j", 0, full_panels, 1, panel([Vec(0, v) for v in range(4)], n_rows, length))
        if edge:
            vecs = [Vec(0, v, min(4, edge - 4 * v)) for v in range(-(-edge // 4))]
            panels += [f"(local.set $j (i32.const {full_panels}))", *panel(vecs, n_rows, length)]
        return _loop("$kb", 0, blocks, 1, k_block + panels)

    k_block = [
        # block kb = (ky, kx, channel block cb): t = ky*kw + kx
        f"(local.set $t (i32.div_u (local.get $kb) (i32.const {c_blocks})))",
        f"(local.set $c0 (i32.mul (i32.rem_u (local.get $kb) (i32.const {c_blocks})) (i32.const {K_BLOCK})))",
        "(local.set $first (i32.eqz (local.get $kb)))",
        f"(local.set $last (i32.eq (local.get $kb) (i32.const {blocks - 1})))",
        f"(local.set $klen (select (i32.sub (i32.const {c_in}) (local.get $c0)) (i32.const {K_BLOCK})"
        f" (i32.lt_u (i32.sub (i32.const {c_in}) (local.get $c0)) (i32.const {K_BLOCK}))))",
        f"(local.set $k0 (i32.add (i32.mul (local.get $t) (i32.const {c_in})) (local.get $c0)))",
        f"(local.set $abase (i32.add (i32.const {x}) (i32.add (i32.mul (local.get $c0) (i32.const {plane}))"
        f" (i32.shl (i32.add (i32.mul (i32.div_u (local.get $t) (i32.const {kw})) (i32.const {dh * wp}))"
        f" (i32.mul (i32.rem_u (local.get $t) (i32.const {kw})) (i32.const {dw}))) (i32.const 2)))))",
    ]
    if last_len:  # stride 1: the line's last row is shorter
        full_groups = rows - 1
        tail = [f"(local.set $oy0 (i32.const {rows - 1}))", *group(1, last_len)]
    else:
        full_groups, left = divmod(rows, group_rows)
        tail = [f"(local.set $oy0 (i32.const {full_groups * group_rows}))", *group(left, row_len)] if left else []
    start, stop = groups[:2] if groups is not None else (0, full_groups + bool(tail))
    code = _loop("$oy0", start * group_rows, min(stop, full_groups) * group_rows, group_rows, group(group_rows, row_len))
    code += tail if stop > full_groups else []
    decls = ["(local $kb i32) (local $t i32) (local $c0 i32) (local $k0 i32) (local $klen i32) (local $abase i32)",
             "(local $j i32) (local $oy0 i32) (local $oy i32) (local $oyend i32) (local $ox i32) (local $arow i32) (local $crow i32)",
             "(local $bblock i32) (local $bend i32) (local $bend4 i32) (local $first i32) (local $last i32)",
             "(local $pa i32) (local $pb i32) (local $pc i32) (local $pr i32) (local $pbias i32)",
             "(local $pend i32) (local $pend4 i32)",
             *tile_locals(), *scratch_locals("v128")]
    title = (f"Y^T[{_yt_pixels(spec)} x {oc}] in rows of {row_len} pixels, {group_rows} row(s) at a time, over "
             f"{blocks} K blocks of (ky, kx, <= {K_BLOCK} channels), line width {line}, {epilogue or 'no activation'}")
    return _func(name, title, decls, code)


# i8x16.shuffle lane lists for a 4x4 transpose of f32 lanes: interleave low / high halves of two rows,
# then take the 64-bit halves of two interleaved results.
_LO, _HI = shuffle_lanes(0, 4, 1, 5), shuffle_lanes(2, 6, 3, 7)
_HALF_LO, _HALF_HI = shuffle_lanes(0, 1, 4, 5), shuffle_lanes(2, 3, 6, 7)


def _render_transpose(spec, yt: int, y: int, residual: int | None, epilogue: str | None, name: str,
                      rows: tuple[int, int] | None = None) -> str:
    """y[oc][oy][ox] = act(Y^T[oy*line + ox][oc] + residual[oc][oy][ox]); 4 pixels x 4 channels per
    step with shuffles, scalar at the row's and the channels' ends."""
    oh, ow, oc, pixels = spec.out_height, spec.out_width, spec.out_channels, spec.pixels
    line, c_row = _line_width(spec), _channels_padded(spec) * 4
    oc4, ow4 = oc // 4 * 4, ow // 4 * 4
    src_at = f"(i32.add (i32.const {yt}) (i32.add (i32.mul (i32.add (i32.mul (local.get $oy) (i32.const {line})) (local.get $ox)) (i32.const {c_row})) (i32.shl (local.get $c) (i32.const 2))))"
    dst_off = f"(i32.shl (i32.add (i32.add (i32.mul (local.get $c) (i32.const {pixels})) (i32.mul (local.get $oy) (i32.const {ow}))) (local.get $ox)) (i32.const 2))"

    def finish_v(reg: str, at: str) -> list[str]:
        code = []
        if residual is not None:
            code.append(f"(local.set {reg} (f32x4.add (local.get {reg}) (v128.load (i32.add (i32.const {residual}) {at}))))")
        return code + v128_activation(epilogue, reg)

    block = ["(local.set $s (local.get $src))"]
    block += [f"(local.set $r{i} (v128.load offset={i * c_row} (local.get $s)))" for i in range(4)]
    block += [f"(local.set $u0 (i8x16.shuffle {_LO} (local.get $r0) (local.get $r1)))",
              f"(local.set $u1 (i8x16.shuffle {_HI} (local.get $r0) (local.get $r1)))",
              f"(local.set $u2 (i8x16.shuffle {_LO} (local.get $r2) (local.get $r3)))",
              f"(local.set $u3 (i8x16.shuffle {_HI} (local.get $r2) (local.get $r3)))",
              f"(local.set $r0 (i8x16.shuffle {_HALF_LO} (local.get $u0) (local.get $u2)))",
              f"(local.set $r1 (i8x16.shuffle {_HALF_HI} (local.get $u0) (local.get $u2)))",
              f"(local.set $r2 (i8x16.shuffle {_HALF_LO} (local.get $u1) (local.get $u3)))",
              f"(local.set $r3 (i8x16.shuffle {_HALF_HI} (local.get $u1) (local.get $u3)))",
              f"(local.set $d {dst_off})"]
    for i in range(4):
        at = f"(i32.add (local.get $d) (i32.const {i * pixels * 4}))"
        block += finish_v(f"$r{i}", at)
        block.append(f"(v128.store (i32.add (i32.const {y}) {at}) (local.get $r{i}))")
    vector = [f"(local.set $src {src_at})", *block]

    scalar = [f"(local.set $x (f32.load {src_at}))"]
    if residual is not None:
        scalar.append(f"(local.set $x (f32.add (local.get $x) (f32.load (i32.add (i32.const {residual}) {dst_off}))))")
    scalar += [*f32_activation(epilogue, "$x"), f"(f32.store (i32.add (i32.const {y}) {dst_off}) (local.get $x))"]

    row = _loop("$c", 0, oc4, 4, _loop("$ox", 0, ow4, 4, vector))
    row += _loop("$c", 0, oc4, 1, _loop("$ox", ow4, ow, 1, scalar))  # the row's last 1-3 pixels
    row += _loop("$c", oc4, oc, 1, _loop("$ox", 0, ow, 1, scalar))   # the last 1-3 channels
    decls = ["(local $oy i32) (local $ox i32) (local $c i32) (local $s i32) (local $src i32) (local $d i32) (local $x f32)",
             "(local $r0 v128) (local $r1 v128) (local $r2 v128) (local $r3 v128)",
             "(local $u0 v128) (local $u1 v128) (local $u2 v128) (local $u3 v128)",
             *scratch_locals("v128"), *scratch_locals("f32")]
    title = f"Y^T [{line}-pixel lines x {oc}] -> NCHW {oc}x{oh}x{ow}{' + residual' if residual is not None else ''}, {epilogue or 'no activation'}"
    first, stop = rows if rows is not None else (0, oh)
    return _func(name, title, decls, _loop("$oy", first, stop, 1, row))
