"""The ready-made kernels the WebAssembly backend offers the lowerings: the packed-panel SIMD GEMM
(`backends/wasm/gemm.py`) for MatMul and Gemm, and im2col + GEMM (`kernels/conv.py`) for 2-D Conv,
or, where `Conv2dHooks.prefers_implicit_gemm`, the implicit GEMM over output pixels with the weight
packed at compile time (`kernels/conv_implicit_gemm.py`).

`hooks(options)` is what the builder sees (how to pack a weight, how much scratch a kernel needs);
`render_intrinsic` turns an `Intrinsic` statement into WAT functions once the memory plan has
placed its buffers. A `residual` operand (the lowering's fused residual Add, see `_fused_epilogue` in
`ir/ops/nn.py`) is added by the kernel before the activation. Opt-level 0 (plain loops) and z
(smallest code) use none of them.
"""

from __future__ import annotations

import numpy as np

from backends.wasm.gemm import SCALAR, gemm_scratch_bytes, pack_b, packed_b_size, render_gemm, render_pack_b
from backends.wasm.kernels.conv import (Conv2dSpec, conv_scratch_bytes, pack_conv_weight, render_conv2d,
                                        weight_packs_as_a)
from backends.wasm.kernels.conv_implicit_gemm import implicit_gemm_is_faster
from backends.wasm.options import WasmOptions
from ir.loops.program import Intrinsic


class GemmHooks:
    @staticmethod
    def pack_weight(weights: np.ndarray, trans_b: bool) -> np.ndarray:
        return np.frombuffer(pack_b(weights, trans_b), dtype="<f4")

    @staticmethod
    def packed_elements(k: int, n: int) -> int:
        return packed_b_size(k, n) // 4

    @staticmethod
    def a_scratch_elements(m: int, k: int) -> int:
        """Room for one packed block of A: the kernel's fast path reads a tile's 4 rows in one load."""
        return gemm_scratch_bytes(m, k) // 4


class Conv2dHooks:
    def __init__(self, features: frozenset[str]):
        self.features = features

    def prefers_implicit_gemm(self, params: dict) -> bool:
        """Whether this Conv runs faster as an implicit GEMM (its weight then packed by `pack_weight`)."""
        return implicit_gemm_is_faster(Conv2dSpec(**params), self.features)

    def packs_weight_as_a(self, params: dict) -> bool:
        """Whether this im2col Conv's weight is best packed at compile time as the GEMM's A (then
        `packed_a`, and `pack_weight` packs it)."""
        return weight_packs_as_a(Conv2dSpec(**params), self.features)

    @staticmethod
    def pack_weight(params: dict, weights: np.ndarray) -> np.ndarray:
        return pack_conv_weight(Conv2dSpec(**params), weights)

    @staticmethod
    def scratch_elements(params: dict) -> int:
        return conv_scratch_bytes(Conv2dSpec(**params)) // 4


def hooks(options: WasmOptions) -> dict:
    if options.opt_level in ("0", "z"):
        return {}
    return {"gemm": GemmHooks(), "conv2d": Conv2dHooks(kernel_features(options))}


def kernel_features(options: WasmOptions) -> frozenset[str]:
    if not options.simd:
        return SCALAR
    return frozenset({"simd", "relaxed-simd"} if options.relaxed_simd else {"simd"})


def render_intrinsic(stmt: Intrinsic, name: str, options: WasmOptions) -> str:
    """WAT functions implementing `stmt`, the one to call being `$name`."""
    ops, p = stmt.operands, stmt.params
    features = kernel_features(options)
    if stmt.name == "conv2d":
        bias, residual = ops.get("bias"), ops.get("residual")
        spec = Conv2dSpec(**{k: v for k, v in p.items() if k != "epilogue"})
        return render_conv2d(spec, epilogue=p.get("epilogue"), x_offset=_at(ops["x"]), w_offset=_at(ops["w"]), y_offset=_at(ops["y"]),
                             scratch_offset=_at(ops["scratch"]), bias_offset=_at(bias) if bias is not None else None,
                             residual_offset=_at(residual) if residual is not None else None,
                             features=features, name=name)
    if stmt.name == "gemm":
        m, n, k, batch = p["m"], p["n"], p["k"], p.get("batch", 1)
        bias, residual = ops.get("bias"), ops.get("residual")
        scratch = ops.get("b_scratch")
        a_scratch = ops.get("a_scratch")
        funcs, calls = [], []
        if scratch is not None:     # B is an activation: pack it into panels first
            per = packed_b_size(k, n)
            funcs.append(render_pack_b(k, n, src_offset=_at(ops["b"]), dst_offset=_at(scratch), batch=batch,
                                       batch_strides=(k * n * 4, per), name=f"{name}_pack",
                                       features=features & {"simd"}))
            calls.append(f"(call ${name}_pack)")
        b_packed = _at(scratch if scratch is not None else ops["b"])
        funcs.append(render_gemm(m, n, k, a_offset=_at(ops["a"]), b_packed_offset=b_packed, c_offset=_at(ops["c"]),
                                 bias_offset=_at(bias) if bias is not None else None,
                                 residual_offset=_at(residual) if residual is not None else None, features=features,
                                 trans_a=p.get("trans_a", False), batch=batch, epilogue=p.get("epilogue"),
                                 batch_strides=(m * k * 4, packed_b_size(k, n), m * n * 4) if batch > 1 else None,
                                 a_scratch_offset=_at(a_scratch) if a_scratch is not None else None,
                                 name=f"{name}_gemm"))
        calls.append(f"(call ${name}_gemm)")
        return "".join(funcs) + f"(func ${name}\n  " + "\n  ".join(calls) + "\n)\n"
    raise ValueError(f"the WebAssembly backend has no intrinsic {stmt.name!r}")


def _at(buffer) -> int:
    return buffer.storage.offset
