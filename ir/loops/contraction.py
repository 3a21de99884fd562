"""Contractions a target may run as a ready-made kernel: what is computed, not how.

A lowering that recognises a float32 GEMM (MatMul, Gemm) or a 2-D Conv describes it once as a
`GemmSpec` or a `ConvSpec`, and an 8-bit integer GEMM (MatMulInteger, QLinearMatMul, its B a
constant or an activation) as an `IntegerGemmSpec` and an 8-bit Conv (ConvInteger, QLinearConv) as
an `IntegerConvSpec` (shapes, transposes, window geometry, groups, and the epilogue the kernel
applies before it stores: a bias, a residual, an activation), asks the builder whether the target
offers a kernel for it (`LoopBuilder.offers`), and emits it as an `Intrinsic` statement over
`ContractionOperands`. How the target runs it (which weight layout, which scratch, which kernel
variant) is the target's decision, taken from the spec alone by its `ContractionKernels`: the
lowering never learns it, and the target's renderer takes the same decision again from the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from ir.loops.program import Buffer


@dataclass(frozen=True)
class EpilogueSpec:
    """What a contraction's kernel does to each sum before it stores it, in this order: add the
    bias (per column of a GEMM, per output channel of a Conv), add the residual (a tensor of the
    output's shape), apply the activation (one of `epilogue_activations()` of the op registry).
    The registry's `Epilogue` says what a kernel may absorb of an op; this, what one kernel does."""
    bias: bool = False
    residual: bool = False
    activation: str | None = None


@dataclass(frozen=True)
class GemmSpec:
    """C[m, n] = epilogue(A[m, k] @ B[k, n]), `batch` times over consecutive row-major matrices.
    `trans_a`: A given as [k, m]; `trans_b`: B given as [n, k]; `constant_b`: B is a weight known at
    compile time (the target may repack it then), else an activation. `b_format`: how a constant B
    is stored: "f32", or narrow ("bf16", "int8" with a scale per column, ir/loops/narrow_weights.py),
    which the kernel widens as it reads it."""
    kind: ClassVar[str] = "gemm"
    m: int
    n: int
    k: int
    batch: int = 1
    trans_a: bool = False
    trans_b: bool = False
    constant_b: bool = True
    epilogue: EpilogueSpec = EpilogueSpec()
    b_format: str = "f32"


@dataclass(frozen=True)
class ConvSpec:
    """A 2-D Conv on NCHW tensors with static shapes, weight [out_channels, in_channels/groups,
    *kernel]. `pads` are (top, left, bottom, right), ONNX's order (begins, then ends);
    `constant_weight`: the weight is known at compile time."""
    kind: ClassVar[str] = "conv2d"
    batch: int
    in_channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilations: tuple[int, int] = (1, 1)
    groups: int = 1
    constant_weight: bool = True
    epilogue: EpilogueSpec = EpilogueSpec()


@dataclass(frozen=True)
class RequantizeSpec:
    """QLinearMatMul's epilogue: y = saturate(round_half_even(float32(acc) * (a_scale * b_scale) /
    out_scale) + out_zero), every step in float32 and in that order, as the loop-nest lowering does.
    `b_scale_per_column`: b's scale holds N values (else one); `signed_output`: y is int8 (else
    uint8); `out_zero`: there is an output zero point."""
    b_scale_per_column: bool = False
    signed_output: bool = False
    out_zero: bool = True


@dataclass(frozen=True)
class DequantizeSpec:
    """MatMulIntegerToFloat's epilogue, onnxruntime's fused MatMulInteger -> Cast -> Mul(scale) ->
    Add(bias): y = float32(acc) * scale [+ bias] [+ residual], each step rounded to float32 in that
    order (no fused multiply-add), as the unfused loop nests compute it. `scale` is a run-time float32
    operand (a_scale * b_scale, which the graph computes), one value or one per column
    (`scale_per_column`); `bias` a constant per column, `residual` a tensor of the output's shape."""
    scale_per_column: bool = False
    bias: bool = False
    residual: bool = False


@dataclass(frozen=True)
class IntegerGemmSpec:
    """C[m, n] = sum_k (A[m, k] - a_zero) * B'[k, n] over 8-bit A (signed with `a_signed`), `batch`
    times over consecutive row-major matrices. With `constant_b`, B' = B - b_zero is a constant whose
    8-bit B's zero point (per tensor or per column) the lowering has already subtracted: B' lies in
    -255..255, and `b_column_span` is the largest max - min of B' over one column (a target may pick a
    narrower encoding of B' when it is small). Else B is an 8-bit activation (signed with `b_signed`;
    `b_zero`: a per-tensor zero point read at run time), one K x N matrix per product. C is int32
    (MatMulInteger), with `requantize` 8-bit (QLinearMatMul), with `dequantize` float32 (the
    MatMulIntegerToFloat epilogue). `a_zero`: A has a per-tensor zero point, read at run time."""
    kind: ClassVar[str] = "integer_gemm"
    m: int
    n: int
    k: int
    a_signed: bool = False
    a_zero: bool = True
    b_column_span: int = 510
    requantize: RequantizeSpec | None = None
    batch: int = 1
    constant_b: bool = True
    b_signed: bool = False
    b_zero: bool = False
    dequantize: DequantizeSpec | None = None


@dataclass(frozen=True)
class IntegerConvSpec:
    """A 2-D ConvInteger or QLinearConv of `conv`'s geometry (its weight constant, its epilogue
    unused) over 8-bit x (signed with `x_signed`) and a constant W' = W - w_zero whose zero point
    (per tensor or per output channel) the lowering has already subtracted: W' lies in -255..255.
    `x_zero`: x has a per-tensor zero point, read at run time, which is also the padding's value (a
    padded tap then adds nothing, as the loop nest's padded buffer does). y is int32 (ConvInteger),
    or with `requantize` 8-bit (QLinearConv): `bias` (int32, one per output channel) is added to
    each sum first, and the requantisation's `b_scale_per_column` means the weight's scale per
    output channel."""
    kind: ClassVar[str] = "integer_conv2d"
    conv: ConvSpec
    x_signed: bool = False
    x_zero: bool = True
    bias: bool = False
    requantize: RequantizeSpec | None = None


@dataclass(frozen=True)
class BlockQuantGemmSpec:
    """C[m, n] = epilogue(A[m, k] @ B[k, n]) with a constant B stored as onnxruntime's MatMulNBits
    stores it (`BlockQuantWeight`): `bits`-bit unsigned codes in blocks of `block` consecutive k per
    column, each (column, block) with a float32 scale and, with `zero_points`, a zero point code
    (else the middle code 2^(bits-1)); B[k, n] = (code - zero) * scale. Two arithmetics, as the
    node's `accuracy_level` asks:
    - `int8_a` False: A is float32, B widened to exactly the float32 values above.
    - `int8_a` True (accuracy level 4): each row of A is quantized per block of K to int8 as
      onnxruntime's MLAS does (scale = max|a| / 127, code = round_half_even(a * (127 / max|a|)), a
      zero block all zeros), each block's products summed as integers, sum_k qa (code - zero), and
      added to C scaled by scale_a * scale_b, block after block."""
    kind: ClassVar[str] = "block_quant_gemm"
    m: int
    n: int
    k: int
    bits: int
    block: int
    zero_points: bool = False
    int8_a: bool = False
    epilogue: EpilogueSpec = EpilogueSpec()


@dataclass(eq=False)
class BlockQuantWeight:
    """A `BlockQuantGemmSpec`'s B as numbers: `codes` [N, K] (uint8, one code each), `scales` [N,
    blocks] float32, `zeros` [N, blocks] uint8 codes (None: the middle code), `bits` per code."""
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    bits: int

    def dequantized(self, block: int) -> np.ndarray:
        """B as float32 [K, N]: (code - zero) * scale, each rounded to float32 once."""
        zeros = self.zeros if self.zeros is not None else np.full(self.scales.shape, 2 ** (self.bits - 1))
        return np.ascontiguousarray(dequantized_codes(self.codes, self.scales, zeros,
                                                      np.arange(self.codes.shape[1]) // block).T)


def dequantized_codes(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group: np.ndarray) -> np.ndarray:
    """[N, K] float32 (code - zero) * scale, each rounded to float32 once: `scales` and `zeros` are
    [N, groups], `group[k]` the group of k (a block of K, or MatMulNBits' g_idx)."""
    centred = codes.astype(np.float32) - zeros[:, group].astype(np.float32)
    return centred * scales[:, group].astype(np.float32)


ContractionSpec = GemmSpec | ConvSpec | IntegerGemmSpec | IntegerConvSpec | BlockQuantGemmSpec


@dataclass(frozen=True)
class QuantizationOperands:
    """The run-time scalars (and per-column vectors) of an `IntegerGemmSpec` or `IntegerConvSpec`: A's
    (a Conv's input's) zero point, and for its requantisation A's, B's (the weight's) and the
    output's scales and the output's zero point; a run-time B's zero point; the dequantising
    epilogue's scale; None where the spec has none."""
    a_zero: Buffer | None = None
    a_scale: Buffer | None = None
    b_scale: Buffer | None = None
    out_scale: Buffer | None = None
    out_zero: Buffer | None = None
    b_zero: Buffer | None = None
    dequantize_scale: Buffer | None = None

    def buffers(self) -> tuple[Buffer, ...]:
        return tuple(x for x in (self.a_zero, self.a_scale, self.b_scale, self.out_scale, self.out_zero,
                                 self.b_zero, self.dequantize_scale) if x is not None)


@dataclass(eq=False)
class ContractionOperands:
    """The buffers of one contraction: `a` (a GEMM's A, a Conv's input), `b` (a GEMM's B, a Conv's
    weight, either as the target's `weight_layout` packed it), `out`, the epilogue's `bias` and
    `residual` when the spec has them, an integer contraction's `quantization` scalars, and the
    `scratch` the target asked for, in its order."""
    a: Buffer
    b: Buffer
    out: Buffer
    bias: Buffer | None = None
    residual: Buffer | None = None
    scratch: tuple[Buffer, ...] = ()
    quantization: QuantizationOperands | None = None

    def buffers(self) -> tuple[Buffer, ...]:
        quantization = self.quantization.buffers() if self.quantization is not None else ()
        return tuple(x for x in (self.a, self.b, self.out, self.bias, self.residual, *quantization, *self.scratch)
                     if x is not None)


@dataclass(frozen=True)
class WeightLayout:
    """How a target repacks a constant weight for its kernel: the packed constant is named after
    the weight with `suffix`; `shared`: contractions of one weight (and layout) share one packing."""
    suffix: str
    shared: bool = False


def is_empty(spec: ContractionSpec) -> bool:
    """Whether `spec` has a zero extent (a decoder's first step attends to an empty past): no
    target's kernel takes one, and the loop nest computes it right (a K of 0 sums nothing)."""
    if isinstance(spec, IntegerConvSpec):
        return is_empty(spec.conv)
    if isinstance(spec, ConvSpec):
        return 0 in (spec.batch, spec.in_channels, spec.height, spec.width, spec.out_channels)
    if isinstance(spec, BlockQuantGemmSpec):
        return 0 in (spec.m, spec.n, spec.k)
    return 0 in (spec.m, spec.n, spec.k, spec.batch)


@dataclass(frozen=True)
class Scratch:
    """Working memory a target's kernel needs: `elements` float32s, named after operand `of`
    ("a" or "b") with `suffix`."""
    of: str
    suffix: str
    elements: int


class ContractionKernels(Protocol):
    """What a target offers the lowerings (handed to the builder as its `kernels`)."""

    def offers(self, spec: ContractionSpec) -> bool:
        """Whether the target has a kernel for `spec`."""

    def weight_layout(self, spec: ContractionSpec) -> WeightLayout | None:
        """How the kernel for `spec` wants its constant weight; None: as the graph holds it."""

    def pack_weight(self, spec: ContractionSpec, weight: np.ndarray) -> np.ndarray:
        """`weight` in the layout `weight_layout(spec)` names."""

    def scratch(self, spec: ContractionSpec) -> tuple[Scratch, ...]:
        """The working memory the kernel for `spec` needs, in the order it reads it."""
