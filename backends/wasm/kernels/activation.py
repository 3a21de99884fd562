"""Activation epilogues as WAT instructions, in a v128 (4 x f32) and a scalar f32 spelling.

Each function returns the instructions that replace local `reg` by act(reg), using two scratch locals
of the same type (`$v0`, `$v1` for v128, `$t0`, `$t1` for f32) that `scratch_locals` declares.

GELU is the exact (erf) form ONNX uses by default, 0.5 x (1 + erf(x / sqrt 2)). WebAssembly has no
exp or erf, and a range-reduced exp needs integer tricks per lane; instead erf comes from
Abramowitz & Stegun 7.1.28, erf(t) = 1 - (1 + a1 t + ... + a6 t^6)^-16 for t >= 0, whose absolute
error is below 3e-7 (float32 rounding adds about 1e-6 relative): only mul, add and one div per lane.
"""

from __future__ import annotations

from ir.ops.registry import epilogue_activations

# No activation, or one that an op's registration asks of a kernel's epilogue ("relu", "gelu").
EPILOGUES = (None, *epilogue_activations())

# Abramowitz & Stegun 7.1.28 coefficients a6 .. a1 (Horner order).
_ERF_COEFFS = (0.0000430638, 0.0002765672, 0.0001520143, 0.0092705272, 0.0422820123, 0.0705230784)
_INV_SQRT2 = 0.7071067811865476


def check_epilogue(epilogue: str | None) -> None:
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown GEMM epilogue {epilogue!r}; expected one of {EPILOGUES}")


def _f32(x: float) -> str:
    return repr(float(x))


def v128_activation(epilogue: str | None, reg: str) -> list[str]:
    check_epilogue(epilogue)
    get = f"(local.get {reg})"
    if epilogue is None:
        return []
    if epilogue == "relu":
        return [f"(local.set {reg} (f32x4.max {get} (v128.const f32x4 0 0 0 0)))"]
    if epilogue == "gelu":
        return _gelu(reg, lanes="f32x4")
    raise _no_spelling(epilogue)


def f32_activation(epilogue: str | None, reg: str) -> list[str]:
    check_epilogue(epilogue)
    get = f"(local.get {reg})"
    if epilogue is None:
        return []
    if epilogue == "relu":
        return [f"(local.set {reg} (f32.max {get} (f32.const 0)))"]
    if epilogue == "gelu":
        return _gelu(reg, lanes="f32")
    raise _no_spelling(epilogue)


def _no_spelling(epilogue: str) -> ValueError:
    """A registered activation these kernels have no WAT for yet: fail rather than compute another."""
    return ValueError(f"GEMM epilogue {epilogue!r} has no WebAssembly spelling")


def _const(lanes: str, x: float) -> str:
    if lanes == "f32":
        return f"(f32.const {_f32(x)})"
    return f"(v128.const f32x4 {' '.join([_f32(x)] * 4)})"


def _gelu(reg: str, lanes: str) -> list[str]:
    """q = (1 + a1 t + ... + a6 t^6)^-16 with t = |x|/sqrt2 (so erf(t) = 1 - q);
    gelu = x - x q / 2 for x >= 0, and x q / 2 for x < 0."""
    op = lambda name: f"{lanes}.{name}"  # noqa: E731
    x = f"(local.get {reg})"
    t0, t1 = "$t0" if lanes == "f32" else "$v0", "$t1" if lanes == "f32" else "$v1"
    t = f"({op('mul')} ({op('abs')} {x}) {_const(lanes, _INV_SQRT2)})"
    code = [f"(local.set {t0} {t})"]
    # Horner: p = ((a6 t + a5) t + ...) t + a1) t + 1
    horner = _const(lanes, _ERF_COEFFS[0])
    for a in _ERF_COEFFS[1:]:
        horner = f"({op('add')} ({op('mul')} {horner} (local.get {t0})) {_const(lanes, a)})"
    horner = f"({op('add')} ({op('mul')} {horner} (local.get {t0})) {_const(lanes, 1.0)})"
    code.append(f"(local.set {t1} {horner})")
    for _ in range(4):  # p^16 by squaring
        code.append(f"(local.set {t1} ({op('mul')} (local.get {t1}) (local.get {t1})))")
    # half_xq = 0.5 x / p^16
    code.append(f"(local.set {t0} ({op('div')} ({op('mul')} {x} {_const(lanes, 0.5)}) (local.get {t1})))")
    if lanes == "f32":
        code.append(f"(local.set {reg} (select ({op('sub')} {x} (local.get {t0})) (local.get {t0}) "
                    f"({op('ge')} {x} (f32.const 0))))")
    else:
        code.append(f"(local.set {reg} (v128.bitselect ({op('sub')} {x} (local.get {t0})) (local.get {t0}) "
                    f"({op('ge')} {x} (v128.const f32x4 0 0 0 0))))")
    return code


def scratch_locals(lanes: str) -> list[str]:
    """The declarations the activations above need."""
    return ["(local $t0 f32) (local $t1 f32)"] if lanes == "f32" else ["(local $v0 v128) (local $v1 v128)"]
