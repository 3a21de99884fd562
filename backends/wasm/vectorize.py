"""SIMD128 rendering of innermost loops.

A loop is vectorised four lanes at a time when its body is only stores whose index moves by one
element per iteration into 4-byte (f32 or i32) buffers or of i32 values into 1-byte buffers (the low
byte of each lane, as i32.store8 keeps it: one shuffle and a 32-bit lane store; QuantizeLinear's
and DynamicQuantizeLinear's outputs), float reductions into accumulators
(`acc = acc + x`, also *, max, min: four partial lanes, folded after the vector part) and
iteration-private locals (set before they are read in each iteration: one v128 local each, whose
last lane is copied back to the scalar after the vector part), and every value it stores, assigns
or accumulates is built from operations SIMD128 has: loads that are contiguous (v128.load),
strided (stride 2 or 3: two overlapping v128.loads and one shuffle that never reads past the last
lane's element; larger positive strides: one load per lane) or loop-invariant (scalar load +
splat), arithmetic, min/max, comparisons feeding a select, f32<->i32 conversions and bit
reinterpretations (no instruction: a v128 has no lane type) and fma (relaxed
madd when `relaxed-simd` is on) and the f32 math calls with an f32x4 version in `mathlib` (exp,
log, tanh, erf, pow; at opt-level 3 exp, log and erf are written inline). `select(a > b, a, b)`
and `select(a < b, a, b)` on f32 become one `f32x4.pmax` / `f32x4.pmin` (one maxps/minps on x86,
where the NaN-propagating f32x4.max is a long sequence); they keep the select's NaN behaviour:
`b` when the comparison is unordered.
Anything else (other math calls, gathers, 8-byte types) keeps the scalar loop.
The trip count splits into an unrolled vector part, a plain vector part and a scalar tail.
"""

from __future__ import annotations

from codegen.affine import stride_of
from codegen.reductions import ReductionStep, reduction_step
from ir.loops.expr import COMPARISONS, Binary, Cast, Expr, Fma, Load, Local, Select, Unary, Var, uses, walk
from ir.loops.program import Assign, Loop, Store

from backends.wasm.mathlib import INLINE_VECTOR_FUNCTIONS, VECTOR_MATH, VECTOR_MATH_BINARY, inline_vector_call
from backends.wasm.simd_lanes import strided_load

LANES = 4
_VECTOR_DTYPES = ("float32", "int32")
_BYTE_DTYPES = ("uint8", "int8", "bool")
_LOW_BYTES = "0 4 8 12 0 4 8 12 0 4 8 12 0 4 8 12"   # i8x16.shuffle: each 32-bit lane's low byte
_F32_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "min": "min", "max": "max"}
_I32_BINARY = {"add": "i32x4.add", "sub": "i32x4.sub", "mul": "i32x4.mul", "min": "i32x4.min_s",
               "max": "i32x4.max_s", "and": "v128.and", "or": "v128.or", "xor": "v128.xor"}
_F32_COMPARE = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne"}
_I32_COMPARE = {"lt": "lt_s", "le": "le_s", "gt": "gt_s", "ge": "ge_s", "eq": "eq", "ne": "ne"}
_F32_UNARY = ("neg", "abs", "sqrt", "floor", "ceil", "trunc", "nearest")
_I32_UNARY = ("neg", "abs")


# Reductions a vector accumulator can carry (every op of codegen.reductions.ASSOCIATIVE): op ->
# (lane identity, f32x4 instruction). max and min run on pmax/pmin (one maxps/minps on the
# loop-carried path, where the NaN-propagating f32x4.max is a chain of eight instructions under
# Cranelift) and a second partial ORs in which lanes saw a NaN,
# so the folded result is NaN exactly when wasm's max/min would give NaN. (The sign of a zero
# maximum may differ: pmax does not order -0 below +0.)
_REDUCTIONS = {"add": (0.0, "f32x4.add"), "mul": (1.0, "f32x4.mul"), "max": (float("-inf"), "f32x4.pmax"),
               "min": (float("inf"), "f32x4.pmin")}
_NAN_TRACKED = ("max", "min")


def vectorizable(loop: Loop) -> bool:
    return _private_locals(loop) is not None


def _private_locals(loop: Loop) -> set[int] | None:
    """The uids of the loop's iteration-private locals, or None when the loop cannot be vectorised."""
    if loop.extent < LANES or not loop.body:
        return None
    var = loop.var
    private: set[int] = set()
    accumulators: set[int] = set()
    read: set[int] = set()              # locals read so far in the body
    for s in loop.body:
        if isinstance(s, Assign):
            uid = s.local.uid
            step = _vector_reduction(s) if uid not in private else None
            if step is not None and (uid in accumulators or uid not in read):
                if not _vector_ok(step.operand, var, private) or not _varies(step.operand, var, private):
                    return None
                accumulators.add(uid)
            elif s.local.type in ("f32", "i32") and uid not in accumulators and \
                    (uid in private or (uid not in read and not uses(s.value, s.local))):
                if not _vector_ok(s.value, var, private):
                    return None
                private.add(uid)
            else:
                return None
        elif isinstance(s, Store):
            stored = s.buffer.dtype in _VECTOR_DTYPES or (s.buffer.dtype in _BYTE_DTYPES and s.value.type == "i32")
            if not stored or stride_of(s.index, var) != 1 \
                    or _reads_private(s.index, private):
                return None
            if not _vector_ok(s.value, var, private):
                return None
        else:
            return None
        read |= {x.uid for e in s.exprs() for x in walk(e) if isinstance(x, Local)}
    # an accumulator is only read by its own update: its partial lanes mean nothing elsewhere
    for s in loop.body:
        reads = {x.uid for e in s.exprs() for x in walk(e) if isinstance(x, Local)}
        own = {s.local.uid} if isinstance(s, Assign) else set()
        if (reads - own) & accumulators:
            return None
    return private


def _vector_reduction(s: Assign) -> ReductionStep | None:
    """The reduction `s` makes, if a vector accumulator can carry it: f32 only (an f32x4 of partials)."""
    return reduction_step(s) if s.local.type == "f32" else None


def _reads_private(e: Expr, private: set[int]) -> bool:
    return any(isinstance(x, Local) and x.uid in private for x in walk(e))


def _varies(e: Expr, var: Var, private: set[int]) -> bool:
    """Whether `e` differs between lanes: it uses the loop index or an iteration-private local."""
    return any(x is var or (isinstance(x, Local) and x.uid in private) for x in walk(e))


def _load_stride(e: Load, var: Var) -> int | None:
    """The element stride of a vectorisable load, else None."""
    step = stride_of(e.index, var)
    return step if step is not None and step >= 0 else None


def _vector_ok(e: Expr, var: Var, private: set[int]) -> bool:
    if not _varies(e, var, private):
        return e.type in ("f32", "i32")             # rendered once as a scalar and splatted
    if e.type not in ("f32", "i32"):
        return False
    if isinstance(e, Local):
        return True                                 # a private local (the only kind that varies)
    if isinstance(e, Load):
        return e.buffer.dtype in _VECTOR_DTYPES and not _reads_private(e.index, private) \
            and _load_stride(e, var) is not None
    if isinstance(e, Binary):
        table = _F32_BINARY if e.type == "f32" else _I32_BINARY
        if e.type == "f32" and e.a.type == "f32" and e.op in VECTOR_MATH_BINARY:
            return _vector_ok(e.a, var, private) and _vector_ok(e.b, var, private)
        return e.op in table and _vector_ok(e.a, var, private) and _vector_ok(e.b, var, private)
    if isinstance(e, Unary):
        if e.op == "reinterpret":
            return e.a.type in ("f32", "i32") and _vector_ok(e.a, var, private)
        if e.type == "f32" and e.a.type == "f32" and e.op in VECTOR_MATH:
            return _vector_ok(e.a, var, private)
        return e.op in (_F32_UNARY if e.type == "f32" else _I32_UNARY) and _vector_ok(e.a, var, private)
    if isinstance(e, Select):
        return _mask_ok(e.cond, var, private) and _vector_ok(e.a, var, private) and _vector_ok(e.b, var, private)
    if isinstance(e, Cast):
        return (e.a.type, e.type) in (("f32", "i32"), ("i32", "f32")) and _vector_ok(e.a, var, private)
    if isinstance(e, Fma):
        return e.type == "f32" and all(_vector_ok(x, var, private) for x in (e.a, e.b, e.c))
    return False


def _mask_ok(cond: Expr, var: Var, private: set[int]) -> bool:
    if not _varies(cond, var, private):
        return True
    return (isinstance(cond, Binary) and cond.op in COMPARISONS and cond.a.type in ("f32", "i32")
            and _vector_ok(cond.a, var, private) and _vector_ok(cond.b, var, private))


def _pseudo_min_max(e: Select) -> str | None:
    """"pmax" for select(a > b, a, b), "pmin" for select(a < b, a, b) on f32: both give b where
    the comparison is unordered, as f32x4.pmax(b, a) / f32x4.pmin(b, a) do."""
    c = e.cond
    if e.type != "f32" or not isinstance(c, Binary) or c.a is not e.a or c.b is not e.b:
        return None
    return {"gt": "pmax", "lt": "pmin"}.get(c.op)


class VectorRenderer:
    def __init__(self, scalar, loop: Loop, var: str):
        self.scalar = scalar           # the WatRenderer, for scalar sub-expressions and addresses
        self.loop = loop
        self.var = var
        self.private = _private_locals(loop)

    def render(self, indent: str, start: int = 0, stop: int | None = None) -> str:
        """The loop over [start, stop) (default: all of it; a part of a kernel, kernel_parts.py)."""
        extent, unroll = self.loop.extent if stop is None else stop, self.scalar.options.unroll
        # each accumulator gets a v128 partial per lane, folded into the scalar after the vector part;
        # each private local one v128 for its four lanes' values
        self.partials, self.lanes, self.operands, self.nans = {}, {}, {}, {}
        for s in self.loop.body:
            if isinstance(s, Assign):
                table = self.lanes if s.local.uid in self.private else self.partials
                if s.local.uid not in table:
                    table[s.local.uid] = self.scalar.vector_local()
                    if table is self.partials and _vector_reduction(s).op in _NAN_TRACKED:
                        self.operands[s.local.uid] = self.scalar.vector_local()
                        self.nans[s.local.uid] = self.scalar.vector_local()
        vector_body = "\n".join(indent + "  " + self.statement(s) for s in self.loop.body)
        scalar_body = self.scalar.stmts(self.loop.body, depth=0, indent=indent + "  ")
        whole = start + (extent - start) // LANES * LANES
        unrolled = start + (extent - start) // (LANES * unroll) * LANES * unroll if unroll > 1 else start
        parts = [self.init_partials(indent),
                 self.scalar.counted_loop(self.var, start, unrolled, LANES, [vector_body] * unroll, indent),
                 self.scalar.counted_loop(self.var, unrolled, whole, LANES, [vector_body], indent),
                 self.fold_partials(indent),
                 self.last_lanes(indent),
                 self.scalar.counted_loop(self.var, whole, extent, 1, [scalar_body], indent)]
        return "\n".join(p for p in parts if p)

    def statement(self, s) -> str:
        if isinstance(s, Store):
            return self.store(s)
        if s.local.uid in self.lanes:
            return f"(local.set {self.lanes[s.local.uid]} {self.vector(s.value)})"
        op, operand = _vector_reduction(s)
        partial = self.partials[s.local.uid]
        if op in _NAN_TRACKED:
            # pmax(x, acc) is `x < acc ? acc : x`: the max of numbers; the NaN lanes are remembered
            value, nan = self.operands[s.local.uid], self.nans[s.local.uid]
            return (f"(local.set {value} {self.vector(operand)}) "
                    f"(local.set {partial} ({_REDUCTIONS[op][1]} (local.get {value}) (local.get {partial}))) "
                    f"(local.set {nan} (v128.or (local.get {nan}) (f32x4.ne (local.get {value}) (local.get {value}))))")
        return f"(local.set {partial} ({_REDUCTIONS[op][1]} (local.get {partial}) {self.vector(operand)}))"

    def accumulations(self):
        """The loop's accumulator updates, the first of each accumulator."""
        seen = set()
        for s in self.loop.body:
            if isinstance(s, Assign) and s.local.uid in self.partials and s.local.uid not in seen:
                seen.add(s.local.uid)
                yield s

    def init_partials(self, indent: str) -> str:
        lines = []
        for s in self.accumulations():
            op = _vector_reduction(s).op
            lines.append(f"{indent}(local.set {self.partials[s.local.uid]} (f32x4.splat (f32.const {_f32(_REDUCTIONS[op][0])})))")
            if op in _NAN_TRACKED:
                lines.append(f"{indent}(local.set {self.nans[s.local.uid]} (v128.const i32x4 0 0 0 0))")
        return "\n".join(lines)

    def fold_partials(self, indent: str) -> str:
        lines = []
        for s in self.accumulations():
            op = _vector_reduction(s).op
            name, partial = self.scalar.local_name(s.local), self.partials[s.local.uid]
            total = f"(local.get {name})"
            for lane in range(LANES):
                total = f"(f32.{op} {total} (f32x4.extract_lane {lane} (local.get {partial})))"
            lines.append(f"{indent}(local.set {name} {total})")
            if op in _NAN_TRACKED:
                lines.append(f"{indent}(if (v128.any_true (local.get {self.nans[s.local.uid]})) "
                             f"(then (local.set {name} (f32.const nan))))")
        return "\n".join(lines)

    def last_lanes(self, indent: str) -> str:
        """Private locals hold, after the vector part, what the last vectorised iteration set."""
        lines = []
        for s in self.loop.body:
            if isinstance(s, Assign) and s.local.uid in self.lanes:
                shape = "f32x4" if s.local.type == "f32" else "i32x4"
                lines.append(f"{indent}(local.set {self.scalar.local_name(s.local)} "
                             f"({shape}.extract_lane {LANES - 1} (local.get {self.lanes[s.local.uid]})))")
        return "\n".join(dict.fromkeys(lines))

    def store(self, s: Store) -> str:
        address = self.scalar.address(s.buffer, s.index)
        if s.buffer.dtype in _BYTE_DTYPES:
            return (f"(v128.store32_lane offset={s.buffer.storage.offset} 0 {address} "
                    f"(i8x16.shuffle {_LOW_BYTES} {self.vector(s.value)} (v128.const i32x4 0 0 0 0)))")
        return f"(v128.store offset={s.buffer.storage.offset} {address} {self.vector(s.value)})"

    def load(self, e: Load) -> str:
        offset, address = e.buffer.storage.offset, self.scalar.address(e.buffer, e.index)
        step = _load_stride(e, self.loop.var)
        if step == 1:
            return f"(v128.load offset={offset} {address})"
        if step == 0:
            return f"(v128.load32_splat offset={offset} {address})"
        return strided_load(address, step, offset, e.buffer.storage.itemsize)

    def vector(self, e: Expr) -> str:
        if not _varies(e, self.loop.var, self.private):
            return f"({'f32x4' if e.type == 'f32' else 'i32x4'}.splat {self.scalar.expr(e)})"
        if isinstance(e, Local):
            return f"(local.get {self.lanes[e.uid]})"
        if isinstance(e, Load):
            return self.load(e)
        if isinstance(e, Binary):
            a, b = self.vector(e.a), self.vector(e.b)
            if e.type == "f32" and e.op in VECTOR_MATH_BINARY:
                self.scalar.math_used.add(VECTOR_MATH_BINARY[e.op])
                return f"(call ${VECTOR_MATH_BINARY[e.op]} {a} {b})"
            if e.type == "f32":
                return f"(f32x4.{_F32_BINARY[e.op]} {a} {b})"
            return f"({_I32_BINARY[e.op]} {a} {b})"
        if isinstance(e, Unary) and e.op == "reinterpret":
            return self.vector(e.a)                 # a v128 has no lane type: the same bits
        if isinstance(e, Unary) and e.op in VECTOR_MATH:
            name = VECTOR_MATH[e.op]
            if name in INLINE_VECTOR_FUNCTIONS and self.scalar.options.opt_level == "3":
                return inline_vector_call(name, [self.vector(e.a)], self.scalar.options.relaxed_simd,
                                          self.scalar.vector_local)
            self.scalar.math_used.add(name)
            return f"(call ${name} {self.vector(e.a)})"
        if isinstance(e, Unary):
            return f"({'f32x4' if e.type == 'f32' else 'i32x4'}.{e.op} {self.vector(e.a)})"
        if isinstance(e, Select):
            pseudo = _pseudo_min_max(e)
            if pseudo is not None:
                return f"(f32x4.{pseudo} {self.vector(e.b)} {self.vector(e.a)})"
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
        if not _varies(cond, self.loop.var, self.private):
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
