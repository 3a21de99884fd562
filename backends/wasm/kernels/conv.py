"""Conv2D as GEMM: im2col straight into the packed-B panel layout, then the GEMM micro-kernel.

For one image and one group, Y[oc, p] = sum_k W[oc, k] * col[k, p] + bias[oc], with k running over
(input channel, ky, kx) and p over output pixels (oy, ox). So A is the weight exactly as ONNX
stores it (OC x C/g*KH*KW, row-major: no repacking), B is the im2col matrix (packed at run time,
in one pass, into 16-pixel panels), and C is the NCHW output itself, with a per-row (per-channel)
bias and any residual in the same NCHW layout. A 1x1 stride-1 unpadded Conv needs no im2col: its
input already is B, which `render_pack_b` packs. A depthwise Conv (one channel per group) would be
a one-row product per channel: it runs the direct kernel of `kernels/depthwise.py` instead. A
Conv whose spec says `implicit_gemm` runs the other orientation, `kernels/conv_implicit_gemm.py`
(output pixels as rows, the weight packed at compile time as B, no im2col); which Convs take it is
decided there, by `implicit_gemm_is_faster`. Where the output is larger than L2 (vgg19's 112x112
and 56x56 layers), the im2col Conv runs in chunks of output rows, each packed and then multiplied
over every K block (`im2col_chunk_rows`), so that neither C nor the packed B of a chunk leaves the
caches between passes; so does a Conv whose im2col alone is larger than L2 (the 7x7 stem, 1x1s of
256 channels at 56x56), 1x1s included.

Entry point
- `render_conv2d(spec, at, *, epilogue=None, features=SIMD_FMA, name="conv") -> str`: WAT functions
  at the offsets `at` (`ConvOffsets`, kernels/operands.py), the one to call being `$name` (no
  parameters); `conv_scratch_bytes(spec)` is what it needs at `at.scratch` (the packed im2col of
  one image, all groups, or of one chunk of rows, and the GEMM's A blocks). With `spec.implicit_gemm` or `spec.packed_a`
  the weight at `at.w` is `pack_conv_weight(spec, w)`, not ONNX's layout.
- `weight_packs_as_a(spec, features)`: whether the lowering should pack this Conv's (constant) weight
  at compile time in the GEMM's packed-A layout (then `packed_a=True`), so that the kernel reads it as
  it is instead of copying blocks of it into its scratch on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from backends.wasm.gemm import (C_CHUNK_BYTES, SIMD_FMA, gemm_scratch_bytes, k_block_size, pack_a, packed_a_size,
                                packed_b_size, packs_a, render_gemm)
from backends.wasm.kernels.conv_implicit_gemm import (implicit_gemm_scratch_bytes, pack_implicit_gemm_weight,
                                                      render_conv2d_implicit_gemm)
from backends.wasm.kernels.depthwise import depthwise_scratch_bytes, is_depthwise, render_depthwise
from backends.wasm.kernels.microkernel import PANEL
from backends.wasm.kernels.operands import ConvOffsets, GemmLayout, GemmOffsets
from backends.wasm.kernels.pack_b import render_pack_b
from backends.wasm.simd_lanes import strided_load
from ir.loops.contraction import ConvSpec, EpilogueSpec, GemmSpec


@dataclass(frozen=True)
class Conv2dSpec(ConvSpec):
    """A Conv (its target-neutral `ConvSpec` geometry) and the kernel variant that runs it."""
    implicit_gemm: bool = False  # output pixels as GEMM rows, the weight as packed B (conv_implicit_gemm.py)
    packed_a: bool = False       # im2col, the weight given as the GEMM's packed A (gemm.pack_a, per group)

    def __post_init__(self):
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"channels {self.in_channels} -> {self.out_channels} do not split into {self.groups} groups")
        if self.implicit_gemm and self.groups != 1:
            raise ValueError(f"a grouped Conv ({self.groups} groups) runs on im2col, not as an implicit GEMM")
        if self.packed_a and (self.implicit_gemm or is_depthwise(self)):
            raise ValueError("only an im2col Conv (not implicit GEMM, not depthwise) reads its weight as packed A")
        if self.out_height < 1 or self.out_width < 1:
            raise ValueError(f"Conv output would be empty: {self}")

    @property
    def out_height(self) -> int:
        (kh, _), (sh, _), (dh, _) = self.kernel, self.strides, self.dilations
        return (self.height + self.pads[0] + self.pads[2] - dh * (kh - 1) - 1) // sh + 1

    @property
    def out_width(self) -> int:
        (_, kw), (_, sw), (_, dw) = self.kernel, self.strides, self.dilations
        return (self.width + self.pads[1] + self.pads[3] - dw * (kw - 1) - 1) // sw + 1

    @property
    def gemm_k(self) -> int:
        return self.in_channels // self.groups * self.kernel[0] * self.kernel[1]

    @property
    def pixels(self) -> int:
        return self.out_height * self.out_width

    @property
    def is_pointwise(self) -> bool:
        return (self.kernel == (1, 1) and self.strides == (1, 1) and self.pads == (0, 0, 0, 0))


def conv_scratch_bytes(spec: Conv2dSpec) -> int:
    """The packed im2col of one image (all groups), then room for the GEMM's packed A blocks; for a
    depthwise Conv, the zero-bordered plane of the direct kernel."""
    if spec.implicit_gemm:
        return implicit_gemm_scratch_bytes(spec)
    if is_depthwise(spec):
        return depthwise_scratch_bytes(spec)
    if spec.packed_a:
        return _im2col_bytes(spec)
    return _im2col_bytes(spec) + gemm_scratch_bytes(spec.out_channels // spec.groups, spec.gemm_k)


def im2col_chunk_rows(spec: Conv2dSpec) -> int | None:
    """Output rows per chunk where an im2col Conv runs in chunks of rows, each packed and then
    multiplied over every K block, or None for the whole image at once.

    Where the output (C) is larger than L2, the GEMM would cut its columns into chunks anyway
    (`gemm._chunk_panels`); cutting the im2col into the same chunks also keeps the packed B of a
    chunk (K x its pixels) in cache between its packing and the product, instead of writing the
    whole image's (9 x the input for a 3x3 kernel: 58 MB for vgg19's 128->128 at 112x112) to
    memory and reading it back, and the scratch shrinks to one chunk's. A chunk is the rows whose
    output is about C_CHUNK_BYTES, rounded up (at most to twice that) to rows that fill whole
    16-pixel panels, so that no chunk has an edge panel but the last. Measured (Conv + bias + relu,
    A packed at compile time, wasmtime 50, relaxed SIMD, CPU time, min of 9 interleaved rounds, ms,
    whole image / the GEMM's column chunks alone / chunks of rows): vgg19's 3x3 64->128 at 112x112
    53.8 / 45.1 / 41.4, 128->128 at 112x112 108.7 / 89.1 / 81.4, 128->256 at 56x56 44.3 / 40.8 /
    39.2, 256->256 at 56x56 86.2 / 80.7 / 78.4, 256->512 at 28x28 39.7 / 40.1 / 38.6, 512->512 at
    28x28 80.4 / 79.2 / 79.4."""
    if spec.implicit_gemm or is_depthwise(spec) or spec.groups != 1:
        return None
    m, n, k = spec.out_channels, spec.pixels, spec.gemm_k
    ow = spec.out_width
    if not spec.is_pointwise and k > k_block_size(k) and m * n * 4 > 4 * C_CHUNK_BYTES:
        target = max(1, C_CHUNK_BYTES // (m * 4 * ow))
        rows = next((r for r in range(target, 2 * target + 1) if r * ow % PANEL == 0), target)
        return rows if rows < spec.out_height else None
    return _b_chunk_rows(spec)


# Bytes of the packed B (im2col) past which it is packed and multiplied in chunks of output rows
# (more than a core's L2), and the size of such a chunk (see `_b_chunk_rows`).
IM2COL_WHOLE_BYTES = 2 << 20
IM2COL_CHUNK_BYTES = 256 << 10


def _b_chunk_rows(spec: Conv2dSpec) -> int | None:
    """Output rows per chunk where the packed B of the whole image (K x pixels) would not stay in L2
    between its packing and its product, or None: rows whose B is about IM2COL_CHUNK_BYTES, a multiple
    of the rows that fill whole 16-pixel panels, so that no chunk has an edge panel but the last.
    This holds where C alone would not ask for chunks: the 7x7 stride-2 stem (3->64 at 224x224, one
    K block, a 7.4 MB im2col), 3x3s on 28x28-56x56 outputs of 128 channels, 1x1s of 256 channels at
    56x56; a chunk whose rows would hold more than twice that (odd widths: 16 rows) is not worth it.
    Measured (bias + relu, relaxed SIMD, wasmtime, CPU time, medians of 7 interleaved rounds of 8
    copies of the Conv called in turn, so that weights, inputs and scratch are as cold as in a model
    run, ms, whole image -> chunks of 4 rows): 7x7s2 3->64 at 224x224 5.94 -> 5.14, 3x3s2 128->128
    at 56x56 4.78 -> 4.61, 3x3 128->128 at 28x28 4.63 -> 4.58, 1x1 256->128 at 56x56 4.33 -> 4.22;
    chunks of 1-16 rows of the stem all ran at 5.05-5.15."""
    k, ow = spec.gemm_k, spec.out_width
    if k * spec.pixels * 4 <= IM2COL_WHOLE_BYTES:
        return None
    unit = PANEL // math.gcd(ow, PANEL)
    rows = max(unit, round(IM2COL_CHUNK_BYTES / (k * ow * 4) / unit) * unit)
    return rows if rows < spec.out_height and rows * k * ow * 4 <= 2 * IM2COL_CHUNK_BYTES else None


def weight_packs_as_a(spec: Conv2dSpec, features) -> bool:
    """Whether an im2col Conv's GEMM reads its weight packed (more than one 4-row tile, SIMD128): then
    packing it at compile time saves the kernel's run-time packing of A. That packing costs most where
    few pixels share it: measured (relaxed SIMD, wasmtime 50, CPU time, median of 9 interleaved rounds,
    ms, packed at run time -> at compile time) 3x3 512->512 at 7x7 5.40 -> 5.13, 1x1 2048->512 at 7x7
    2.49 -> 2.30, 3x3 512->512 at 14x14 19.15 -> 18.82; large images unchanged (7x7s2 3->96 at 224
    8.70 -> 8.60). Whole models, sum of per-CU min_ms of `cortex bench --repeat 3`, median of 3
    interleaved rounds: light_resnet50 200.5 -> 191.3, light_zfnet512 92.6 -> 89.5, light_vgg19
    953.9 -> 946.9, light_bvlc_alexnet 40.5 -> 39.8."""
    return not spec.implicit_gemm and not is_depthwise(spec) and packs_a(spec.out_channels // spec.groups, features)


def pack_conv_weight(spec: Conv2dSpec, w: np.ndarray, channel_bounds=None) -> np.ndarray:
    """The weight as `render_conv2d` reads it: ONNX's [OC, C/g, kh, kw] as is for im2col, each group's
    [OC/g, K] as `gemm.pack_a` with `packed_a`, 16-channel panels for the implicit GEMM; with
    `channel_bounds` (one group, packed A), each range of output channels packed on its own, one
    after the other, as `render_conv2d_channel_parts` reads them."""
    if spec.implicit_gemm:
        return pack_implicit_gemm_weight(spec, w)
    w = np.asarray(w, dtype=np.float32)
    if spec.packed_a and channel_bounds is not None:
        rows = w.reshape(spec.out_channels, spec.gemm_k)
        return np.concatenate([pack_a(rows[start:stop]) for start, stop in channel_bounds])
    if spec.packed_a:
        per_group = w.reshape(spec.groups, spec.out_channels // spec.groups, spec.gemm_k)
        return np.concatenate([pack_a(a) for a in per_group])
    return w


def _im2col_bytes(spec: Conv2dSpec) -> int:
    rows = im2col_chunk_rows(spec)
    return spec.groups * packed_b_size(spec.gemm_k, spec.pixels if rows is None else rows * spec.out_width)


def render_conv2d(spec: Conv2dSpec, at: ConvOffsets, *, epilogue: str | None = None, features=SIMD_FMA,
                  name: str = "conv") -> str:
    if spec.implicit_gemm:
        return render_conv2d_implicit_gemm(spec, at, epilogue=epilogue, features=features, name=name)
    if is_depthwise(spec):
        return render_depthwise(spec, at, epilogue=epilogue, features=features, name=name)
    if im2col_chunk_rows(spec) is not None:
        return _render_conv2d_chunked(spec, at, epilogue=epilogue, features=features, name=name)
    g = spec.groups
    m, n, k = spec.out_channels // g, spec.pixels, spec.gemm_k
    funcs, calls = [], []
    simd = frozenset(features) & {"simd"}
    product = GemmSpec(m, n, k, batch=g, epilogue=EpilogueSpec(at.bias is not None, at.residual is not None, epilogue))
    a_stride = packed_a_size(m, k) if spec.packed_a else m * k * 4
    layout = GemmLayout(batch_strides=(a_stride, packed_b_size(k, n), m * n * 4), bias_per_row=True,
                        a_packed=spec.packed_a)
    for image in range(spec.batch):  # each image gets its own pair: every offset stays a constant
        x, y, res = _image_offsets(spec, at, image)
        pack_name, gemm_name = f"{name}_pack_{image}", f"{name}_gemm_{image}"
        if spec.is_pointwise:
            funcs.append(render_pack_b(k, n, src_offset=x, dst_offset=at.scratch, batch=g, name=pack_name,
                                       features=simd))
        else:
            funcs.append(_render_im2col(spec, x, at.scratch, pack_name, vector="simd" in simd))
        offsets = GemmOffsets(at.w, at.scratch, y, bias=at.bias, residual=res,
                              a_scratch=None if spec.packed_a else at.scratch + _im2col_bytes(spec))
        funcs.append(render_gemm(product, offsets, features=features, layout=layout, name=gemm_name))
        calls += [f"  (call ${pack_name})", f"  (call ${gemm_name})"]
    title = (f"  ;; Conv {spec.in_channels}x{spec.height}x{spec.width} -> {spec.out_channels}x{spec.out_height}x"
             f"{spec.out_width}, kernel {spec.kernel}, groups {g}, batch {spec.batch}: im2col + GEMM")
    return "".join(funcs) + "\n".join([f"(func ${name}", title, *calls, ")"]) + "\n"


def _render_conv2d_chunked(spec: Conv2dSpec, at: ConvOffsets, *, epilogue: str | None, features,
                           name: str) -> str:
    """One group, chunks of `im2col_chunk_rows` output rows: for each, the im2col of its rows into
    the scratch, then the GEMM of its columns of C (NCHW rows `pixels` apart), both functions of
    the chunk's first row / its byte offset in C; the last, shorter chunk has its own pair."""
    rows, oh, ow = im2col_chunk_rows(spec), spec.out_height, spec.out_width
    funcs = _chunk_functions(spec, at, at.scratch, epilogue, features, name)
    calls = [c for image in range(spec.batch) for c in _chunk_calls(spec, name, image, 0, -(-oh // rows))]
    title = (f"  ;; Conv {spec.in_channels}x{spec.height}x{spec.width} -> {spec.out_channels}x{oh}x{ow}, kernel "
             f"{spec.kernel}, batch {spec.batch}: im2col + GEMM in chunks of {rows} output rows")
    return funcs + "\n".join([f"(func ${name}", title, "  (local $oy0 i32)", *calls, ")"]) + "\n"


def render_conv2d_chunk_parts(spec: Conv2dSpec, at: ConvOffsets, bounds, *, epilogue: str | None, features,
                              name: str) -> tuple[str, list[str]]:
    """The chunked Conv as parts (backends/wasm/kernel_parts.py): part p runs chunks
    [start, stop) of `bounds[p]` of every image with the scratch `p * conv_scratch_bytes(spec)`
    after `at.scratch`, its own. Returns the functions and the parts' names, in order."""
    rows, oh = im2col_chunk_rows(spec), spec.out_height
    funcs, names = [], []
    for p, (start, stop) in enumerate(bounds):
        part = f"{name}_part{p}"
        pair_funcs = _chunk_functions(spec, at, at.scratch + p * conv_scratch_bytes(spec), epilogue, features, part)
        calls = [c for image in range(spec.batch) for c in _chunk_calls(spec, part, image, start, stop)]
        funcs.append(pair_funcs + "\n".join([f"(func ${part}", f"  ;; chunks {start}..{stop - 1} of "
                                             f"{-(-oh // rows)} ({rows} output rows each)", "  (local $oy0 i32)",
                                             *calls, ")"]) + "\n")
        names.append(part)
    return "".join(funcs), names


def render_conv2d_channel_parts(spec: Conv2dSpec, at: ConvOffsets, bounds, *, epilogue: str | None, features,
                                name: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """A one-group im2col Conv with its weight packed by `pack_conv_weight(spec, w, bounds)` as
    parts (backends/wasm/kernel_parts.py): per image, the im2col (or 1x1 packing) of the whole image
    into the scratch, then part p's GEMM of output channels `bounds[p]` over it. Returns the
    functions and, per image, (the im2col to call first, the parts' names)."""
    m, n, k = spec.out_channels, spec.pixels, spec.gemm_k
    simd = frozenset(features) & {"simd"}
    layout = GemmLayout(bias_per_row=True, a_packed=True)
    funcs, steps = [], []
    for image in range(spec.batch):
        x, y, res = _image_offsets(spec, at, image)
        pack_name = f"{name}_pack_{image}"
        funcs.append(_render_image_pack(spec, x, at.scratch, pack_name, simd))
        names, a_at = [], at.w
        for p, (start, stop) in enumerate(bounds):
            product = GemmSpec(stop - start, n, k, epilogue=EpilogueSpec(at.bias is not None, at.residual is not None,
                                                                         epilogue))
            offsets = GemmOffsets(a_at, at.scratch, y + start * n * 4,
                                  bias=None if at.bias is None else at.bias + start * 4,
                                  residual=None if res is None else res + start * n * 4)
            names.append(f"{name}_{image}_part{p}")
            funcs.append(render_gemm(product, offsets, features=features, layout=layout, name=names[-1]))
            a_at += packed_a_size(stop - start, k)
        steps.append((pack_name, names))
    return "".join(funcs), steps


def _image_offsets(spec: Conv2dSpec, at: ConvOffsets, image: int) -> tuple[int, int, int | None]:
    """Where image `image` of the batch reads its input and writes its output (and its residual)."""
    x_image = spec.in_channels * spec.height * spec.width * 4
    y_image = spec.out_channels * spec.pixels * 4
    residual = None if at.residual is None else at.residual + image * y_image
    return at.x + image * x_image, at.y + image * y_image, residual


def _render_image_pack(spec: Conv2dSpec, x: int, scratch: int, name: str, simd: frozenset[str]) -> str:
    """One image's B of the Conv's GEMM into `scratch`, every group's: a 1x1 Conv's input packed as
    it is, any other's im2col."""
    if spec.is_pointwise:
        return render_pack_b(spec.gemm_k, spec.pixels, src_offset=x, dst_offset=scratch, batch=spec.groups,
                             name=name, features=simd)
    return _render_im2col(spec, x, scratch, name, vector="simd" in simd)


def render_conv2d_group_parts(spec: Conv2dSpec, at: ConvOffsets, bounds, *, epilogue: str | None, features,
                              name: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """A grouped im2col Conv with its weight packed per group (`pack_conv_weight`) as parts
    (backends/wasm/kernel_parts.py): per image, the im2col of every group into the scratch, then part
    p's batched GEMM over groups `bounds[p]`, each group's output channels reading only its own
    input channels. Returns the functions and, per image, (the im2col to call first, the parts' names)."""
    g = spec.groups
    m, n, k = spec.out_channels // g, spec.pixels, spec.gemm_k
    simd = frozenset(features) & {"simd"}
    a_stride, b_stride, c_stride = packed_a_size(m, k), packed_b_size(k, n), m * n * 4
    layout = GemmLayout(batch_strides=(a_stride, b_stride, c_stride), bias_per_row=True, a_packed=True)
    funcs, steps = [], []
    for image in range(spec.batch):
        x, y, res = _image_offsets(spec, at, image)
        pack_name = f"{name}_pack_{image}"
        funcs.append(_render_image_pack(spec, x, at.scratch, pack_name, simd))
        names = []
        for p, (start, stop) in enumerate(bounds):
            product = GemmSpec(m, n, k, batch=stop - start,
                               epilogue=EpilogueSpec(at.bias is not None, at.residual is not None, epilogue))
            offsets = GemmOffsets(at.w + start * a_stride, at.scratch + start * b_stride, y + start * c_stride,
                                  bias=None if at.bias is None else at.bias + start * m * 4,
                                  residual=None if res is None else res + start * c_stride)
            names.append(f"{name}_{image}_part{p}")
            funcs.append(render_gemm(product, offsets, features=features, layout=layout, name=names[-1]))
        steps.append((pack_name, names))
    return "".join(funcs), steps


def _chunk_functions(spec: Conv2dSpec, at: ConvOffsets, scratch: int, epilogue: str | None, features,
                     name: str) -> str:
    """Each image's im2col and GEMM functions of a whole chunk and of the shorter last one, at `scratch`."""
    rows, oh, ow = im2col_chunk_rows(spec), spec.out_height, spec.out_width
    m, n, k = spec.out_channels, spec.pixels, spec.gemm_k
    simd = frozenset(features) & {"simd"}
    last = oh % rows
    funcs = []
    for image in range(spec.batch):
        x, y, res = _image_offsets(spec, at, image)
        offsets = GemmOffsets(at.w, scratch, y, bias=at.bias, residual=res,
                              a_scratch=None if spec.packed_a else scratch + _im2col_bytes(spec))
        for part, count in (("", rows), ("_last", last)):
            if not count:
                continue
            pack_name, gemm_name = f"{name}_pack_{image}{part}", f"{name}_gemm_{image}{part}"
            funcs.append(_render_im2col(spec, x, scratch, pack_name, vector="simd" in simd, rows=count))
            product = GemmSpec(m, count * ow, k, epilogue=EpilogueSpec(at.bias is not None, at.residual is not None,
                                                                      epilogue))
            layout = GemmLayout(ldc=n, bias_per_row=True, a_packed=spec.packed_a, c_shift=True)
            funcs.append(render_gemm(product, offsets, features=features, layout=layout, name=gemm_name))
    return "".join(funcs)


def _chunk_calls(spec: Conv2dSpec, name: str, image: int, start: int, stop: int) -> list[str]:
    """The calls that run chunks [start, stop) of `image` (the shorter last one among them if any)."""
    rows, oh, ow = im2col_chunk_rows(spec), spec.out_height, spec.out_width
    full = oh // rows
    calls = []
    if min(stop, full) > start:
        calls += [
            f"  (local.set $oy0 (i32.const {start * rows}))",
            "  (loop $chunks",
            f"    (call ${name}_pack_{image} (local.get $oy0))",
            f"    (call ${name}_gemm_{image} (i32.mul (local.get $oy0) (i32.const {ow * 4})))",
            f"    (local.set $oy0 (i32.add (local.get $oy0) (i32.const {rows})))",
            f"    (br_if $chunks (i32.lt_u (local.get $oy0) (i32.const {min(stop, full) * rows}))))",
        ]
    if stop > full:     # the shorter last chunk
        calls += [f"  (call ${name}_pack_{image}_last (i32.const {full * rows}))",
                  f"  (call ${name}_gemm_{image}_last (i32.const {full * rows * ow * 4}))"]
    return calls


def _render_im2col(spec: Conv2dSpec, src: int, dst: int, name: str, vector: bool = False,
                   rows: int | None = None) -> str:
    """dst[group][p / 16][k][p % 16] = x[c, oy*sh - pt + ky*dh, ox*sw - pl + kx*dw] (0 in the padding
    and past the last pixel), with k = (c, ky, kx) inside the group and p = (oy, ox).

    For one (c, ky, kx) the columns ox whose input column is inside the image form one range
    [$lo, $hi), computed once; each output row is then zeros, a copy, zeros, with no bounds test
    per pixel (a row whose input row is padding is all zeros). With `vector` (SIMD128) each run is
    cut at the 16-pixel panel boundaries, inside which consecutive pixels are contiguous in dst, and
    every segment is moved 4 pixels per v128 (`_vector_run`), its last 0-3 pixels one by one.

    With `rows`, only output rows $oy0 .. $oy0 + rows (the function's parameter), as the pixels
    p = (oy - $oy0, ox) of a B that many rows wide."""
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel, spec.strides, spec.dilations
    pt, pl = spec.pads[0], spec.pads[1]
    h, w, oh, ow = spec.height, spec.width, spec.out_height, spec.out_width
    k_total, pixels = spec.gemm_k, spec.pixels
    oy = "(local.get $oy)"
    if rows is not None:
        oh, pixels, oy = rows, rows * ow, "(i32.add (local.get $oy0) (local.get $oy))"
    channels = spec.in_channels  # all groups at once: group = c // (C/g), k = c % (C/g) * kh*kw + ...
    per_group = spec.in_channels // spec.groups
    group_bytes = packed_b_size(k_total, pixels)
    panel_stride = k_total * PANEL * 4
    lines = [
        f"(func ${name}{' (param $oy0 i32)' if rows is not None else ''}",
        f"  ;; im2col of {channels}x{h}x{w} for a {kh}x{kw} kernel into 16-pixel panels ({spec.groups} groups)"
        + (f", {rows} output rows from $oy0" if rows is not None else ""),
        "  (local $c i32) (local $ky i32) (local $kx i32) (local $oy i32) (local $ox i32) (local $k i32)",
        "  (local $iy i32) (local $p i32) (local $row i32) (local $lo i32) (local $hi i32) (local $t i32)",
        "  (local $pa i32) (local $stop i32) (local $end i32) (local $q i32)",
    ]

    def first_ox(bound: str) -> str:
        """The first ox with ox*sw >= bound (bound may be negative), clamped to [0, ow]."""
        return (f"(select (i32.const 0) (select (i32.const {ow}) (i32.div_s (i32.add {bound} (i32.const {sw - 1})) (i32.const {sw}))"
                f" (i32.gt_s (i32.div_s (i32.add {bound} (i32.const {sw - 1})) (i32.const {sw})) (i32.const {ow})))"
                f" (i32.le_s {bound} (i32.const 0)))")

    # where pixel $p of the k row at $row lies in the packed panels
    address = (f"(i32.add (local.get $row) (i32.add (i32.mul (i32.shr_u (local.get $p) (i32.const 4))"
               f" (i32.const {panel_stride})) (i32.shl (i32.and (local.get $p) (i32.const 15)) (i32.const 2))))")

    def store_at_p(value: str) -> str:
        return f"(f32.store {address} {value})"

    def run(until: str, body: list[str]) -> list[str]:
        """Pixels $p .. until (exclusive, possibly none), each running `body` then advancing $p."""
        return [f"(local.set $stop {until})",
                "(block $pixels_done (loop $pixels",
                "  (br_if $pixels_done (i32.ge_u (local.get $p) (local.get $stop)))",
                *("  " + b for b in body),
                "  (local.set $p (i32.add (local.get $p) (i32.const 1)))",
                "  (br $pixels)))"]

    if vector:
        zero_run = lambda until: _vector_run(until, address, sw, copying=False)  # noqa: E731
        copy_run = lambda until: _vector_run(until, address, sw, copying=True)  # noqa: E731
    else:
        zero_run = lambda until: run(until, [store_at_p("(f32.const 0)")])  # noqa: E731
        copy_run = lambda until: run(until, [store_at_p("(f32.load (local.get $pa))"),  # noqa: E731
                                             f"(local.set $pa (i32.add (local.get $pa) (i32.const {sw * 4})))"])
    row_start = f"(i32.mul (local.get $oy) (i32.const {ow}))"
    body = [
        # $row: where this k row starts in the packed B of the channel's group
        f"(local.set $k (i32.add (i32.mul (i32.rem_u (local.get $c) (i32.const {per_group})) (i32.const {kh * kw}))"
        f" (i32.add (i32.mul (local.get $ky) (i32.const {kw})) (local.get $kx))))",
        f"(local.set $row (i32.add (i32.const {dst}) (i32.add (i32.mul (i32.div_u (local.get $c) (i32.const {per_group}))"
        f" (i32.const {group_bytes})) (i32.mul (local.get $k) (i32.const {PANEL * 4})))))",
        # input column of ox is ox*sw + $t: inside the image for ox in [$lo, $hi)
        f"(local.set $t (i32.sub (i32.mul (local.get $kx) (i32.const {dw})) (i32.const {pl})))",
        f"(local.set $lo {first_ox('(i32.sub (i32.const 0) (local.get $t))')})",
        f"(local.set $hi {first_ox(f'(i32.sub (i32.const {w}) (local.get $t))')})",
        "(local.set $hi (select (local.get $hi) (local.get $lo) (i32.gt_s (local.get $hi) (local.get $lo))))",
        "(local.set $p (i32.const 0))",
        *_loop("$oy", oh, [
            f"(local.set $iy (i32.add (i32.sub (i32.mul {oy} (i32.const {sh})) (i32.const {pt}))"
            f" (i32.mul (local.get $ky) (i32.const {dh}))))",
            # unsigned compare: a negative row (top padding) wraps to a huge one
            f"(if (i32.lt_u (local.get $iy) (i32.const {h}))",
            "  (then",
            f"    (local.set $pa (i32.add (i32.const {src}) (i32.shl (i32.add (i32.mul (i32.add (i32.mul (local.get $c)"
            f" (i32.const {h})) (local.get $iy)) (i32.const {w})) (i32.add (i32.mul (local.get $lo) (i32.const {sw})) (local.get $t)))"
            " (i32.const 2))))",
            *("    " + x for x in zero_run(f"(i32.add {row_start} (local.get $lo))")),
            *("    " + x for x in copy_run(f"(i32.add {row_start} (local.get $hi))")),
            *("    " + x for x in zero_run(f"(i32.add {row_start} (i32.const {ow}))")),
            "  )",
            "  (else",
            *("    " + x for x in zero_run(f"(i32.add {row_start} (i32.const {ow}))")),
            "  ))",
        ]),
    ]
    tail = pixels % PANEL
    if tail:  # the last panel's lanes past the last pixel must hold zeros
        body += [
            f"(local.set $p (i32.const {pixels}))",
            *zero_run(f"(i32.const {pixels - tail + PANEL})"),
        ]
    lines += ["  " + s for s in _loop("$c", channels, _loop("$ky", kh, _loop("$kx", kw, body)))]
    return "\n".join(lines + [")"]) + "\n"


def _strided_load(stride: int) -> str:
    """Four input floats $pa, $pa + stride, ... as one v128, reading only floats of that span."""
    if stride == 1:
        return "(v128.load (local.get $pa))"
    return strided_load("(local.get $pa)", stride)


def _vector_run(until: str, address: str, stride: int, copying: bool) -> list[str]:
    """Pixels $p .. until (exclusive) of the k row at $row: zeros, or (`copying`) the input floats
    $pa, $pa + stride, ...; one segment per panel the run touches, 4 pixels per v128.store."""
    vector, scalar, advance = "(v128.const i32x4 0 0 0 0)", "(f32.const 0)", []
    if copying:
        vector, scalar = _strided_load(stride), "(f32.load (local.get $pa))"
        advance = ["(local.set $pa (i32.add (local.get $pa) (i32.const {})))"]
    step = lambda pixels: [a.format(pixels * stride * 4) for a in advance]  # noqa: E731
    return [f"(local.set $stop {until})",
            "(block $run_done (loop $segments",
            "  (br_if $run_done (i32.ge_u (local.get $p) (local.get $stop)))",
            "  ;; this segment ends at the panel's end or the run's, whichever comes first",
            "  (local.set $end (i32.add (i32.or (local.get $p) (i32.const 15)) (i32.const 1)))",
            "  (local.set $end (select (local.get $end) (local.get $stop) (i32.lt_u (local.get $end) (local.get $stop))))",
            f"  (local.set $q {address})",
            "  (block $quads_done (loop $quads",
            "    (br_if $quads_done (i32.gt_u (i32.add (local.get $p) (i32.const 4)) (local.get $end)))",
            f"    (v128.store (local.get $q) {vector})",
            *("    " + a for a in step(4)),
            "    (local.set $q (i32.add (local.get $q) (i32.const 16)))",
            "    (local.set $p (i32.add (local.get $p) (i32.const 4)))",
            "    (br $quads)))",
            "  (block $singles_done (loop $singles",
            "    (br_if $singles_done (i32.ge_u (local.get $p) (local.get $end)))",
            f"    (f32.store (local.get $q) {scalar})",
            *("    " + a for a in step(1)),
            "    (local.set $q (i32.add (local.get $q) (i32.const 4)))",
            "    (local.set $p (i32.add (local.get $p) (i32.const 1)))",
            "    (br $singles)))",
            "  (br $segments)))"]


def _loop(var: str, count: int, body: list[str]) -> list[str]:
    label = var.replace("$", "$l_")
    return [f"(local.set {var} (i32.const 0))", f"(loop {label}", *("  " + b for b in body),
            f"  (local.set {var} (i32.add (local.get {var}) (i32.const 1)))",
            f"  (br_if {label} (i32.lt_u (local.get {var}) (i32.const {count}))))"]
