"""Contractions a target may run as a ready-made kernel: what is computed, not how.

A lowering that recognises a float32 GEMM (MatMul, Gemm) or a 2-D Conv describes it once as a
`GemmSpec` or a `ConvSpec` (shapes, transposes, window geometry, groups, and the epilogue the kernel
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
    compile time (the target may repack it then), else an activation."""
    kind: ClassVar[str] = "gemm"
    m: int
    n: int
    k: int
    batch: int = 1
    trans_a: bool = False
    trans_b: bool = False
    constant_b: bool = True
    epilogue: EpilogueSpec = EpilogueSpec()


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


ContractionSpec = GemmSpec | ConvSpec


@dataclass(eq=False)
class ContractionOperands:
    """The buffers of one contraction: `a` (a GEMM's A, a Conv's input), `b` (a GEMM's B, a Conv's
    weight, either as the target's `weight_layout` packed it), `out`, the epilogue's `bias` and
    `residual` when the spec has them, and the `scratch` the target asked for, in its order."""
    a: Buffer
    b: Buffer
    out: Buffer
    bias: Buffer | None = None
    residual: Buffer | None = None
    scratch: tuple[Buffer, ...] = ()

    def buffers(self) -> tuple[Buffer, ...]:
        return tuple(x for x in (self.a, self.b, self.out, self.bias, self.residual, *self.scratch) if x is not None)


@dataclass(frozen=True)
class WeightLayout:
    """How a target repacks a constant weight for its kernel: the packed constant is named after
    the weight with `suffix`; `shared`: contractions of one weight (and layout) share one packing."""
    suffix: str
    shared: bool = False


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
