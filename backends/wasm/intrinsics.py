"""The ready-made kernels the WebAssembly backend offers the lowerings: the packed-panel SIMD GEMM
(`backends/wasm/gemm.py`; `kernels/gemv.py` for one or two rows; with SIMD and one batch both also
read a constant B stored bf16 or int8, `kernels/narrow_panels.py`) for a `GemmSpec` (MatMul, Gemm),
and for a `ConvSpec` im2col + GEMM (`kernels/conv.py`) or, where `implicit_gemm_is_faster`, the implicit GEMM over output pixels with
the weight packed at compile time (`kernels/conv_implicit_gemm.py`), and for an `IntegerGemmSpec`
(MatMulInteger, QLinearMatMul with a constant B) the 16-bit dot-product GEMM (`kernels/int8_gemm.py`), and
for an `IntegerConvSpec` (ConvInteger, QLinearConv with a constant weight) its tiles behind an 8-bit
im2col (`kernels/int8_conv.py`).

`kernels(options)` is what the builder sees (`ContractionKernels`: how to pack a weight, how much
scratch a kernel needs, all decided from the spec); `render_intrinsic` turns an `Intrinsic`
statement into WAT functions once the memory plan has placed its buffers, taking the same
decisions again from the same spec (`conv_kernel_spec`, `_gemm_scratch`). A residual (the
lowering's fused residual Add, see `_fused_epilogue` in `ir/ops/nn.py`) is added by the kernel
before the activation. Opt-level 0 (plain loops) and z (smallest code) use none of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from backends.wasm.kernels.block_quant import (BlockQuantOffsets, block_quant_fits, pack_block_quant_b,
                                               render_block_quant_gemm)
from backends.wasm.kernels.block_quant_panels import (pack_block_quant_panels, render_requantized_rows,
                                                      requantized_rows_bytes, uses_gemm_tiles)
from backends.wasm.kernels.block_quant import scratch_bytes as block_quant_scratch_bytes
from backends.wasm.gemm import SCALAR, gemm_scratch_bytes, pack_b, packed_b_size, render_gemm
from backends.wasm.kernel_parts import (PartSplit, render_block_quant_parts, render_gemm_parts, render_split_call,
                                       split_for)
from backends.wasm.kernels.conv import (Conv2dSpec, conv_scratch_bytes, pack_conv_weight, render_conv2d,
                                        render_conv2d_channel_parts, render_conv2d_chunk_parts, render_conv2d_group_parts,
                                        weight_packs_as_a)
from backends.wasm.kernels.conv_implicit_gemm import implicit_gemm_is_faster, render_conv2d_implicit_gemm_parts
from backends.wasm.kernels.gemv import gemv_fits, render_gemv
from backends.wasm.kernels.int8_conv import (IntegerConvOffsets, integer_conv_scratch_bytes, pack_integer_conv_weight,
                                             render_integer_conv)
from backends.wasm.kernels.int8_gemm import (IntegerGemmOffsets, b_panels_bytes, render_integer_gemm, scratch_bytes,
                                             uses_relaxed_dot)
from backends.wasm.kernels.int8_gemm import pack_b as pack_integer_b
from backends.wasm.kernels.narrow_panels import pack_narrow_b
from backends.wasm.kernels.operands import ConvOffsets, GemmLayout, GemmOffsets
from backends.wasm.kernels.pack_b import render_pack_b
from backends.wasm.options import WasmOptions
from ir.loops.contraction import (BlockQuantGemmSpec, BlockQuantWeight, ContractionSpec, ConvSpec, GemmSpec, IntegerConvSpec, IntegerGemmSpec, Scratch,
                                  WeightLayout)
from ir.loops.narrow_weights import NarrowWeight
from ir.loops.program import Intrinsic


class WasmKernels:
    """The `ContractionKernels` of the WebAssembly backend at one set of features."""

    def __init__(self, features: frozenset[str], parts: int = 1):
        self.features = features
        self.parts = parts      # a large contraction's parts on threads (`--features threads`, kernel_parts.py)

    def split(self, spec: ContractionSpec) -> PartSplit | None:
        conv = conv_kernel_spec(spec, self.features) if isinstance(spec, ConvSpec) else None
        return split_for(spec, conv, self.parts)

    def offers(self, spec: ContractionSpec) -> bool:
        if isinstance(spec, BlockQuantGemmSpec):
            return block_quant_fits(spec, self.features)
        if isinstance(spec, (IntegerGemmSpec, IntegerConvSpec)):
            return "simd" in self.features    # without SIMD128 the loop nest is as good
        if isinstance(spec, GemmSpec) and spec.b_format != "f32":   # the SIMD GEMV and GEMM widen narrow panels
            return spec.constant_b and spec.batch == 1 and "simd" in self.features
        return isinstance(spec, (GemmSpec, ConvSpec))

    def weight_layout(self, spec: ContractionSpec) -> WeightLayout | None:
        """A GEMM's constant B in 16-column panels (`gemm.pack_b`); a Conv's weight as its kernel
        reads it (`pack_conv_weight`), packed once per weight."""
        if isinstance(spec, BlockQuantGemmSpec):
            return WeightLayout(f"_q{spec.bits}_{'panels' if uses_gemm_tiles(spec) else 'blocks'}")
        if isinstance(spec, GemmSpec):
            if spec.b_format != "f32":
                return WeightLayout(f"_{spec.b_format}_panels")
            return WeightLayout("_packed") if spec.constant_b else None
        if isinstance(spec, IntegerGemmSpec):   # B' depends on the zero point: one packing per product
            if not spec.constant_b:
                return None
            return WeightLayout("_i7_panels" if uses_relaxed_dot(spec, self.features) else "_i16_panels")
        if isinstance(spec, IntegerConvSpec):   # W' too
            return WeightLayout("_i16_channel_groups")
        conv = conv_kernel_spec(spec, self.features)
        if conv.implicit_gemm:
            return WeightLayout("_panels", shared=True)
        if conv.packed_a:
            split = self.split(spec)
            if split is not None and split.axis == "channels":
                return WeightLayout(f"_packed_a_{split.parts}_parts", shared=True)
            return WeightLayout("_packed_a", shared=True)
        return None

    def pack_weight(self, spec: ContractionSpec, weight: np.ndarray | NarrowWeight | BlockQuantWeight) -> np.ndarray:
        if isinstance(spec, BlockQuantGemmSpec):
            return pack_block_quant_panels(spec, weight) if uses_gemm_tiles(spec) else pack_block_quant_b(spec, weight)
        if isinstance(spec, GemmSpec) and spec.b_format != "f32":
            return pack_narrow_b(weight, spec.trans_b)
        if isinstance(spec, GemmSpec):
            return np.frombuffer(pack_b(weight, spec.trans_b), dtype="<f4")
        if isinstance(spec, IntegerGemmSpec):
            return pack_integer_b(weight, uses_relaxed_dot(spec, self.features))
        if isinstance(spec, IntegerConvSpec):
            return pack_integer_conv_weight(spec, weight)
        split = self.split(spec)
        return pack_conv_weight(conv_kernel_spec(spec, self.features), weight,
                                split.bounds if split is not None and split.axis == "channels" else None)

    def scratch(self, spec: ContractionSpec) -> tuple[Scratch, ...]:
        if isinstance(spec, BlockQuantGemmSpec):
            if uses_gemm_tiles(spec):   # A's packed block, a panel's K block widened to float32, A as int8 reads it
                tiles = gemm_scratch_bytes(spec.m, spec.k, b_format=f"q{spec.bits}")
                return (Scratch("a", "_apack", (tiles + requantized_rows_bytes(spec)) // 4),)
            split = self.split(spec)      # each part its own copy of A's codes, scales and sums
            copies = split.parts if split is not None else 1
            return (Scratch("a", "_q8", copies * -(-block_quant_scratch_bytes(spec) // 4)),)
        if isinstance(spec, GemmSpec):
            panels, blocks = _gemm_scratch(spec, self.features)
            split = self.split(spec)
            if split is not None and blocks is not None:    # each part packs A's blocks into its own
                blocks = Scratch(blocks.of, blocks.suffix, blocks.elements * split.parts)
            return tuple(s for s in (panels, blocks) if s is not None)
        if isinstance(spec, IntegerGemmSpec):
            packed_a, tile, scales = scratch_bytes(spec, uses_relaxed_dot(spec, self.features))
            panels = b_panels_bytes(spec)
            return (Scratch("a", "_i16", packed_a // 4), Scratch("a", "_tile", tile // 4),
                    *((Scratch("b", "_scales", scales // 4),) if scales else ()),
                    *((Scratch("b", "_i16_panels", panels // 4),) if panels else ()))
        if isinstance(spec, IntegerConvSpec):
            col, packed, tile, scales = integer_conv_scratch_bytes(spec)
            return (*((Scratch("a", "_im2col_bytes", -(-col // 4)),) if col else ()), Scratch("a", "_i16", packed // 4),
                    Scratch("a", "_tile", tile // 4), *((Scratch("b", "_scales", scales // 4),) if scales else ()))
        split = self.split(spec)
        copies = split.parts if split is not None and split.axis == "chunks" else 1    # a chunk's im2col per part
        return (Scratch("a", "_im2col", copies * conv_scratch_bytes(conv_kernel_spec(spec, self.features)) // 4),)


def _gemm_scratch(spec: GemmSpec, features: frozenset[str]) -> tuple[Scratch | None, Scratch | None]:
    """(B's panels, packed at run time when B is an activation; one packed block of A, which the
    kernel's fast path reads a tile's 4 rows of in one load, and after it the GEMM's float32 copy of
    a narrow B's panel block), None for one not needed."""
    panels = None if spec.constant_b else Scratch("b", "_panels", packed_b_size(spec.k, spec.n) // 4 * spec.batch)
    b_format = "f32" if gemv_fits(spec, features) else spec.b_format    # the GEMV widens in registers
    blocks = gemm_scratch_bytes(spec.m, spec.k, b_format=b_format) // 4
    return panels, Scratch("a", "_apack", blocks) if blocks else None


def conv_kernel_spec(spec: ConvSpec, features: frozenset[str]) -> Conv2dSpec:
    """The Conv kernel `spec` runs on: the implicit GEMM where it is the faster and the weight is
    packed at compile time, else im2col, reading a constant weight as the GEMM's packed A where
    `weight_packs_as_a`."""
    geometry = Conv2dSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(ConvSpec)})
    if spec.constant_weight and implicit_gemm_is_faster(geometry, features):
        return dataclasses.replace(geometry, implicit_gemm=True)
    if spec.constant_weight and weight_packs_as_a(geometry, features):
        return dataclasses.replace(geometry, packed_a=True)
    return geometry


def kernels(options: WasmOptions) -> WasmKernels | None:
    if options.opt_level in ("0", "z"):
        return None
    return WasmKernels(kernel_features(options), options.kernel_parts if options.threads else 1)


def kernel_features(options: WasmOptions) -> frozenset[str]:
    if not options.simd:
        return SCALAR
    return frozenset({"simd", "relaxed-simd"} if options.relaxed_simd else {"simd"})


def render_intrinsic(stmt: Intrinsic, name: str, options: WasmOptions, table: list[str]) -> str:
    """WAT functions implementing `stmt`, the one to call being `$name`; the parts of a split
    contraction (kernel_parts.py) join the module's function `table`."""
    spec, ops = stmt.spec, stmt.operands
    features = kernel_features(options)
    split = kernels(options).split(spec) if kernels(options) is not None else None
    if split is not None:
        return _render_split(spec, ops, split, features, name, table)
    if isinstance(spec, ConvSpec):
        (scratch,) = ops.scratch
        at = ConvOffsets(_at(ops.a), _at(ops.b), _at(ops.out), _at(scratch), bias=_at_or_none(ops.bias),
                         residual=_at_or_none(ops.residual))
        return render_conv2d(conv_kernel_spec(spec, features), at, epilogue=spec.epilogue.activation,
                             features=features, name=name)
    if isinstance(spec, GemmSpec):
        return _render_gemm_call(spec, ops, features, name)
    if isinstance(spec, IntegerGemmSpec):
        return _render_integer_gemm_call(spec, ops, features, name)
    if isinstance(spec, IntegerConvSpec):
        return _render_integer_conv_call(spec, ops, name)
    if isinstance(spec, BlockQuantGemmSpec) and uses_gemm_tiles(spec):
        (scratch,) = ops.scratch
        gemm = GemmSpec(spec.m, spec.n, spec.k, epilogue=spec.epilogue, b_format=f"q{spec.bits}")
        tiles = gemm_scratch_bytes(spec.m, spec.k, b_format=gemm.b_format)
        if not spec.int8_a:
            at = GemmOffsets(_at(ops.a), _at(ops.b), _at(ops.out), bias=_at_or_none(ops.bias), a_scratch=_at(scratch))
            return render_gemm(gemm, at, features=features, layout=GemmLayout(b_block=spec.block), name=name)
        requantized = _at(scratch) + tiles
        at = GemmOffsets(requantized, _at(ops.b), _at(ops.out), bias=_at_or_none(ops.bias), a_scratch=_at(scratch))
        return (render_requantized_rows(spec.m, spec.k, spec.block, _at(ops.a), requantized, f"{name}_a")
                + render_gemm(gemm, at, features=features, layout=GemmLayout(b_block=spec.block), name=f"{name}_gemm")
                + f"(func ${name}\n  (call ${name}_a)\n  (call ${name}_gemm)\n)\n")
    if isinstance(spec, BlockQuantGemmSpec):
        (scratch,) = ops.scratch
        at = BlockQuantOffsets(_at(ops.a), _at(ops.b), _at(ops.out), _at(scratch), bias=_at_or_none(ops.bias))
        return render_block_quant_gemm(spec, at, features=features, name=name)
    raise ValueError(f"the WebAssembly backend has no kernel for {spec!r}")


def _render_split(spec, ops, split: PartSplit, features: frozenset[str], name: str, table: list[str]) -> str:
    if isinstance(spec, BlockQuantGemmSpec):
        (scratch,) = ops.scratch
        at = BlockQuantOffsets(_at(ops.a), _at(ops.b), _at(ops.out), _at(scratch), bias=_at_or_none(ops.bias))
        funcs, steps = render_block_quant_parts(spec, at, -(-block_quant_scratch_bytes(spec) // 4) * 4, split,
                                                features, name)
        return funcs + render_split_call(name, steps, table)
    if isinstance(spec, ConvSpec):
        (scratch,) = ops.scratch
        at = ConvOffsets(_at(ops.a), _at(ops.b), _at(ops.out), _at(scratch), bias=_at_or_none(ops.bias),
                         residual=_at_or_none(ops.residual))
        conv = conv_kernel_spec(spec, features)
        if split.axis == "pixels":
            funcs, steps = render_conv2d_implicit_gemm_parts(conv, at, split.bounds, epilogue=spec.epilogue.activation,
                                                             features=features, name=name)
        elif split.axis == "chunks":
            funcs, parts = render_conv2d_chunk_parts(conv, at, split.bounds, epilogue=spec.epilogue.activation,
                                                     features=features, name=name)
            steps = [(None, parts)]
        elif split.axis == "groups":
            funcs, steps = render_conv2d_group_parts(conv, at, split.bounds, epilogue=spec.epilogue.activation,
                                                     features=features, name=name)
        else:
            funcs, steps = render_conv2d_channel_parts(conv, at, split.bounds, epilogue=spec.epilogue.activation,
                                                       features=features, name=name)
        return funcs + render_split_call(name, steps, table)
    panels, blocks = _gemm_scratch(spec, features)
    scratch = iter(ops.scratch)
    b_scratch = next(scratch) if panels is not None else None
    a_scratch = next(scratch) if blocks is not None else None
    at = GemmOffsets(_at(ops.a), _at(b_scratch if b_scratch is not None else ops.b), _at(ops.out),
                     bias=_at_or_none(ops.bias), residual=_at_or_none(ops.residual), a_scratch=_at_or_none(a_scratch))
    funcs, steps = render_gemm_parts(spec, at, None if b_scratch is None else _at(ops.b),
                                     0 if blocks is None else blocks.elements * 4, split, features, name)
    return funcs + render_split_call(name, steps, table)


def _render_integer_gemm_call(spec: IntegerGemmSpec, ops, features: frozenset[str], name: str) -> str:
    q = ops.quantization
    packed_a, tile, *rest = ops.scratch
    scales = rest.pop(0) if spec.requantize is not None else None
    panels = rest.pop(0) if not spec.constant_b else None
    at = IntegerGemmOffsets(_at(ops.a), _at(ops.b) if panels is None else _at(panels), _at(ops.out), _at(packed_a),
                            _at(tile), scales=_at_or_none(scales), a_zero=_at_or_none(q.a_zero),
                            a_scale=_at_or_none(q.a_scale), b_scale=_at_or_none(q.b_scale),
                            out_scale=_at_or_none(q.out_scale), out_zero=_at_or_none(q.out_zero),
                            b_source=None if panels is None else _at(ops.b), b_zero=_at_or_none(q.b_zero),
                            dequantize_scale=_at_or_none(q.dequantize_scale), bias=_at_or_none(ops.bias),
                            residual=_at_or_none(ops.residual))
    return render_integer_gemm(spec, at, name=name, relaxed=uses_relaxed_dot(spec, features))


def _render_integer_conv_call(spec: IntegerConvSpec, ops, name: str) -> str:
    q = ops.quantization
    col, *_ = integer_conv_scratch_bytes(spec)
    scratch = list(ops.scratch)
    col_buffer = scratch.pop(0) if col else None
    packed, tile, *scales = scratch
    at = IntegerConvOffsets(_at(ops.a), _at(ops.b), _at(ops.out), _at_or_none(col_buffer), _at(packed), _at(tile),
                            scales=_at(scales[0]) if scales else None, x_zero=_at_or_none(q.a_zero),
                            x_scale=_at_or_none(q.a_scale), w_scale=_at_or_none(q.b_scale),
                            y_scale=_at_or_none(q.out_scale), y_zero=_at_or_none(q.out_zero), bias=_at_or_none(ops.bias))
    return render_integer_conv(spec, at, name=name)


def _render_gemm_call(spec: GemmSpec, ops, features: frozenset[str], name: str) -> str:
    panels, blocks = _gemm_scratch(spec, features)
    scratch = iter(ops.scratch)
    b_scratch = next(scratch) if panels is not None else None
    a_scratch = next(scratch) if blocks is not None else None
    funcs, calls = [], []
    if b_scratch is not None:     # B is an activation: pack it into panels first
        funcs.append(render_pack_b(spec.k, spec.n, src_offset=_at(ops.b), dst_offset=_at(b_scratch),
                                   batch=spec.batch, name=f"{name}_pack", features=features & {"simd"}))
        calls.append(f"(call ${name}_pack)")
    at = GemmOffsets(_at(ops.a), _at(b_scratch if b_scratch is not None else ops.b), _at(ops.out),
                     bias=_at_or_none(ops.bias), residual=_at_or_none(ops.residual), a_scratch=_at_or_none(a_scratch))
    if gemv_fits(spec, features):   # one or two rows: B streams once through 8 accumulators
        funcs.append(render_gemv(spec, at, features=features, name=f"{name}_gemm"))
    else:
        funcs.append(render_gemm(spec, at, features=features, name=f"{name}_gemm"))
    calls.append(f"(call ${name}_gemm)")
    return "".join(funcs) + f"(func ${name}\n  " + "\n  ".join(calls) + "\n)\n"


def _at(buffer) -> int:
    return buffer.storage.offset


def _at_or_none(buffer) -> int | None:
    return buffer.storage.offset if buffer is not None else None
