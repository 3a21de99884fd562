"""SIMD128 rendering of innermost loops.

A loop is vectorised four lanes at a time when its body is only stores whose index moves by one
element per iteration into 4-byte (f32 or i32) buffers and float reductions into accumulators
(`acc = acc + x`, also *, max, min: four partial lanes, folded after the vector part), and every
value it stores or accumulates is built from
operations SIMD128 has: loads that are contiguous (v128.load) or loop-invariant (scalar load +
splat), arithmetic, min/max, comparisons feeding a select, f32<->i32 conversions and fma (relaxed
madd when `relaxed-simd` is on) and the f32 math calls with an f32x4 version in `mathlib` (exp,
log, tanh, erf, pow). Anything else (other math calls, gathers, 8-byte types) keeps the scalar loop.
The trip count splits into an unrolled vector part, a plain vector part and a scalar tail.
"""

from __future__ import annotations

from ir.loops.expr import (COMPARISONS, Binary, Cast, Const, Expr, Fma, Load, Local, Select, Unary, Var,
                           stride_of, uses, walk)
from ir.loops.program import Assign, Loop, Store

from backends.wasm.mathlib import VECTOR_MATH, VECTOR_MATH_BINARY

LANES = 4
_VECTOR_DTYPES = ("float32", "int32")
_F32_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "min": "min", "max": "max"}
_I32_BINARY = {"add": "i32x4.add", "sub": "i32x4.sub", "mul": "i32x4.mul", "min": "i32x4.min_s",
               "max": "i32x4.max_s", "and": "v128.and", "or": "v128.or", "xor": "v128.xor"}
_F32_COMPARE = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne"}
_I32_COMPARE = {"lt": "lt_s", "le": "le_s", "gt": "gt_s", "ge": "ge_s", "eq": "eq", "ne": "ne"}
_F32_UNARY = ("neg", "abs", "sqrt", "floor", "ceil", "trunc", "nearest")
_I32_UNARY = ("neg", "abs")


# Reductions a vector accumulator can carry: op -> (lane identity, f32x4 instruction)
_REDUCTIONS = {"add": (0.0, "f32x4.add"), "mul": (1.0, "f32x4.mul"), "max": (float("-inf"), "f32x4.max"),
               "min": (float("inf"), "f32x4.min")}


def vectorizable(loop: Loop) -> bool:
    if loop.extent < LANES or not loop.body:
        return False
    accumulators = set()
    for s in loop.body:
        if isinstance(s, Assign):
            step = reduction_step(s)
            if step is None or not _vector_ok(step[1], loop.var) or not uses(step[1], loop.var):
                return False
            accumulators.add(s.local.uid)
        elif isinstance(s, Store):
            if s.buffer.dtype not in _VECTOR_DTYPES or stride_of(s.index, loop.var) != 1:
                return False
            if not _vector_ok(s.value, loop.var):
                return False
        else:
            return False
    # an accumulator is only read by its own update: its partial lanes mean nothing elsewhere
    for s in loop.body:
        exprs = [s.value] + ([s.index] if isinstance(s, Store) else [])
        reads = {x.uid for e in exprs for x in walk(e) if isinstance(x, Local)}
        own = {s.local.uid} if isinstance(s, Assign) else set()
        if (reads - own) & accumulators:
            return False
    return True


def reduction_step(s: Assign):
    """(op, operand) when `s` is `acc = acc op operand` (or `operand op acc`) on f32, else None."""
    v = s.value
    if s.local.type != "f32" or not isinstance(v, Binary) or v.op not in _REDUCTIONS:
        return None
    if v.a is s.local and not _reads(v.b, s.local):
        return v.op, v.b
    if v.b is s.local and not _reads(v.a, s.local):
        return v.op, v.a
    return None


def _reads(e: Expr, loc: Local) -> bool:
    return any(x is loc for x in walk(e))


def _vector_ok(e: Expr, var: Var) -> bool:
    if not uses(e, var):
        return e.type in ("f32", "i32")             # rendered once as a scalar and splatted
    if e.type not in ("f32", "i32"):
        return False
    if isinstance(e, Load):
        return e.buffer.dtype in _VECTOR_DTYPES and stride_of(e.index, var) == 1
    if isinstance(e, Binary):
        table = _F32_BINARY if e.type == "f32" else _I32_BINARY
        if e.type == "f32" and e.a.type == "f32" and e.op in VECTOR_MATH_BINARY:
            return _vector_ok(e.a, var) and _vector_ok(e.b, var)
        return e.op in table and _vector_ok(e.a, var) and _vector_ok(e.b, var)
    if isinstance(e, Unary):
        if e.type == "f32" and e.a.type == "f32" and e.op in VECTOR_MATH:
            return _vector_ok(e.a, var)
        return e.op in (_F32_UNARY if e.type == "f32" else _I32_UNARY) and _vector_ok(e.a, var)
    if isinstance(e, Select):
        return _mask_ok(e.cond, var) and _vector_ok(e.a, var) and _vector_ok(e.b, var)
    if isinstance(e, Cast):
        return (e.a.type, e.type) in (("f32", "i32"), ("i32", "f32")) and _vector_ok(e.a, var)
    if isinstance(e, Fma):
        return e.type == "f32" and all(_vector_ok(x, var) for x in (e.a, e.b, e.c))
    return False


def _mask_ok(cond: Expr, var: Var) -> bool:
    if not uses(cond, var):
        return True
    return (isinstance(cond, Binary) and cond.op in COMPARISONS and cond.a.type in ("f32", "i32")
            and _vector_ok(cond.a, var) and _vector_ok(cond.b, var))


class VectorRenderer:
    def __init__(self, scalar, loop: Loop, var: str):
        self.scalar = scalar           # the WatRenderer, for scalar sub-expressions and addresses
        self.loop = loop
        self.var = var

    def render(self, indent: str) -> str:
        extent, unroll = self.loop.extent, self.scalar.options.unroll
        # each accumulator gets a v128 partial per lane, folded into the scalar after the vector part
        self.partials = {s.local.uid: self.scalar.vector_local() for s in self.loop.body if isinstance(s, Assign)}
        vector_body = "\n".join(indent + "  " + self.statement(s) for s in self.loop.body)
        scalar_body = self.scalar.stmts(self.loop.body, depth=0, indent=indent + "  ")
        whole = extent // LANES * LANES
        unrolled = extent // (LANES * unroll) * LANES * unroll if unroll > 1 else 0
        parts = [self.init_partials(indent),
                 self.scalar.counted_loop(self.var, 0, unrolled, LANES, [vector_body] * unroll, indent),
                 self.scalar.counted_loop(self.var, unrolled, whole, LANES, [vector_body], indent),
                 self.fold_partials(indent),
                 self.scalar.counted_loop(self.var, whole, extent, 1, [scalar_body], indent)]
        return "\n".join(p for p in parts if p)

    def statement(self, s) -> str:
        if isinstance(s, Store):
            return self.store(s)
        op, operand = reduction_step(s)
        partial = self.partials[s.local.uid]
        return f"(local.set {partial} ({_REDUCTIONS[op][1]} (local.get {partial}) {self.vector(operand)}))"

    def init_partials(self, indent: str) -> str:
        lines = []
        for s in self.loop.body:
            if isinstance(s, Assign):
                identity = _REDUCTIONS[reduction_step(s)[0]][0]
                lines.append(f"{indent}(local.set {self.partials[s.local.uid]} (f32x4.splat (f32.const {_f32(identity)})))")
        return "\n".join(lines)

    def fold_partials(self, indent: str) -> str:
        lines = []
        for s in self.loop.body:
            if isinstance(s, Assign):
                op = reduction_step(s)[0]
                name, partial = self.scalar.local_name(s.local), self.partials[s.local.uid]
                total = f"(local.get {name})"
                for lane in range(LANES):
                    total = f"(f32.{op} {total} (f32x4.extract_lane {lane} (local.get {partial})))"
                lines.append(f"{indent}(local.set {name} {total})")
        return "\n".join(lines)

    def store(self, s: Store) -> str:
        return (f"(v128.store offset={s.buffer.storage.offset} {self.scalar.address(s.buffer, s.index)} "
                f"{self.vector(s.value)})")

    def vector(self, e: Expr) -> str:
        var = self.loop.var
        if not uses(e, var):
            return f"({'f32x4' if e.type == 'f32' else 'i32x4'}.splat {self.scalar.expr(e)})"
        if isinstance(e, Load):
            return f"(v128.load offset={e.buffer.storage.offset} {self.scalar.address(e.buffer, e.index)})"
        if isinstance(e, Binary):
            a, b = self.vector(e.a), self.vector(e.b)
            if e.type == "f32" and e.op in VECTOR_MATH_BINARY:
                self.scalar.math_used.add(VECTOR_MATH_BINARY[e.op])
                return f"(call ${VECTOR_MATH_BINARY[e.op]} {a} {b})"
            if e.type == "f32":
                return f"(f32x4.{_F32_BINARY[e.op]} {a} {b})"
            return f"({_I32_BINARY[e.op]} {a} {b})"
        if isinstance(e, Unary) and e.op in VECTOR_MATH:
            self.scalar.math_used.add(VECTOR_MATH[e.op])
            return f"(call ${VECTOR_MATH[e.op]} {self.vector(e.a)})"
        if isinstance(e, Unary):
            return f"({'f32x4' if e.type == 'f32' else 'i32x4'}.{e.op} {self.vector(e.a)})"
        if isinstance(e, Select):
            return f"(v128.bitselect {self.vector(e.a)} {self.vector(e.b)} {self.mask(e.cond)})"
        if isinstance(e, Cast):
            op = "i32x4.trunc_sat_f32x4_s" if e.type == "i32" else "f32x4.convert_i32x4_s"
            return f"({op} {self.vector(e.a)})"
        if isinstance(e, Fma):
            a, b, c = self.vector(e.a), self.vector(e.b), self.vector(e.c)
            if self.scalar.options.relaxed_simd:
                return f"(f32x4.relaxed_madd {a} {b} {c})"
            return f"(f32x4.add (f32x4.mul {a} {b}) {c})"
        raise TypeError(f"cannot vectorise {e!r}")

    def mask(self, cond: Expr) -> str:
        if not uses(cond, self.loop.var):
            # a scalar 0/1 condition becomes an all-zeros or all-ones lane mask
            return f"(i32x4.splat (i32.sub (i32.const 0) {self.scalar.expr(cond)}))"
        a, b = self.vector(cond.a), self.vector(cond.b)
        if cond.a.type == "f32":
            return f"(f32x4.{_F32_COMPARE[cond.op]} {a} {b})"
        return f"(i32x4.{_I32_COMPARE[cond.op]} {a} {b})"


def _f32(value: float) -> str:
    if value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    return float(value).hex()
