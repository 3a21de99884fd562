"""Scalar expressions of the loop-nest IR.

An expression computes one scalar of a compute type: `f32`, `f64`, `i32` or `i64` (storage types
such as int8, float16 or bool widen to one of these on load and narrow again on store). Loop
indices and buffer indices are `i32`. Operators are overloaded so lowerings read like the maths
(`x * scale + bias`); comparisons are spelled as functions (`lt(a, b)`) because `==` must stay
object identity. Constructors fold constants and drop neutral terms (`i * 1 + 0` is `i`), which keeps
index expressions small and lets renderers see strides directly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

COMPUTE_TYPES = ("f32", "f64", "i32", "i64")
FLOAT_TYPES = ("f32", "f64")

# Binary ops every renderer must know. Comparisons yield an i32 0/1.
# shr is a logical shift right, sar an arithmetic one (sign-filling).
ARITHMETIC = ("add", "sub", "mul", "div", "rem", "min", "max", "pow", "and", "or", "xor", "shl", "shr", "sar")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
# Unary ops: the first group maps to single instructions on most targets, the second to math calls.
SIMPLE_UNARY = ("neg", "abs", "sqrt", "floor", "ceil", "trunc", "nearest", "not")
# "reinterpret" keeps the bits and changes the type between f32/i32 or f64/i64 (BitCast).
MATH_UNARY = ("exp", "log", "tanh", "erf", "sin", "cos", "tan", "asin", "acos", "atan",
              "sinh", "cosh", "asinh", "acosh", "atanh", "isnan", "isinf_pos", "isinf_neg")

_ids = itertools.count()


class Expr:
    type: str

    # -- arithmetic sugar ---------------------------------------------------------------------
    def __add__(self, other): return binary("add", self, other)
    def __radd__(self, other): return binary("add", other, self)
    def __sub__(self, other): return binary("sub", self, other)
    def __rsub__(self, other): return binary("sub", other, self)
    def __mul__(self, other): return binary("mul", self, other)
    def __rmul__(self, other): return binary("mul", other, self)
    def __truediv__(self, other): return binary("div", self, other)
    def __rtruediv__(self, other): return binary("div", other, self)
    def __mod__(self, other): return binary("rem", self, other)
    def __neg__(self): return unary("neg", self)
    __hash__ = object.__hash__


@dataclass(eq=False)
class Const(Expr):
    value: float | int
    type: str

    def __repr__(self):
        return f"{self.value}:{self.type}"


@dataclass(eq=False)
class Var(Expr):
    """A loop index (i32), bound by exactly one `Loop`."""
    name: str
    type: str = "i32"
    uid: int = field(default_factory=lambda: next(_ids))

    def __repr__(self):
        return self.name


@dataclass(eq=False)
class Local(Expr):
    """A mutable scalar (accumulator), written by `Assign`."""
    name: str
    type: str
    uid: int = field(default_factory=lambda: next(_ids))

    def __repr__(self):
        return f"%{self.name}"


@dataclass(eq=False)
class Load(Expr):
    buffer: object          # ir.loops.program.Buffer
    index: Expr             # flat element index into the buffer's storage
    type: str = ""

    def __post_init__(self):
        self.type = self.type or self.buffer.compute_type

    def __repr__(self):
        return f"{self.buffer.name}[{self.index!r}]"


@dataclass(eq=False)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr
    type: str = ""

    def __repr__(self):
        return f"{self.op}({self.a!r}, {self.b!r})"


@dataclass(eq=False)
class Unary(Expr):
    op: str
    a: Expr
    type: str = ""

    def __repr__(self):
        return f"{self.op}({self.a!r})"


@dataclass(eq=False)
class Select(Expr):
    cond: Expr
    a: Expr                 # taken where cond != 0
    b: Expr
    type: str = ""


@dataclass(eq=False)
class Cast(Expr):
    a: Expr
    type: str


@dataclass(eq=False)
class Fma(Expr):
    """a * b + c; renderers may fuse it (relaxed SIMD, CUDA fmaf) or not."""
    a: Expr
    b: Expr
    c: Expr
    type: str = ""


# -- constructors --------------------------------------------------------------------------------

def const(value, type: str) -> Const:
    if type in FLOAT_TYPES:
        return Const(float(value), type)
    return Const(int(value), type)


def lift(x, like: str = "f32") -> Expr:
    """Turn a Python number into a constant of the other operand's type."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool):
        x = int(x)
    return const(x, like)


def binary(op: str, a, b) -> Expr:
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        raise TypeError("binary() needs at least one expression")
    a = lift(a, b.type if isinstance(b, Expr) else "f32")
    b = lift(b, a.type)
    if a.type != b.type:
        raise TypeError(f"{op}: operand types differ ({a.type} vs {b.type}); insert a cast")
    result_type = "i32" if op in COMPARISONS else a.type
    folded = _fold_binary(op, a, b)
    if folded is not None:
        return folded
    return Binary(op, a, b, result_type)


def unary(op: str, a: Expr) -> Expr:
    if isinstance(a, Const) and op == "neg":
        return const(-a.value, a.type)
    result_type = "i32" if op in ("isnan", "isinf_pos", "isinf_neg") else a.type
    return Unary(op, a, result_type)


def reinterpret(a: Expr, type: str) -> Expr:
    """The same bits read as `type` (an integer and a float type of the same width)."""
    if {a.type, type} not in ({"f32", "i32"}, {"f64", "i64"}):
        raise TypeError(f"cannot reinterpret {a.type} as {type}")
    return Unary("reinterpret", a, type)


def select(cond: Expr, a, b) -> Expr:
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        raise TypeError("select() needs at least one expression operand to fix the result type")
    if isinstance(cond, Const):
        return lift(a, _type_of(b)) if cond.value else lift(b, _type_of(a))
    a = lift(a, _type_of(b))
    b = lift(b, a.type)
    return Select(cond, a, b, a.type)


def cast(a, type: str) -> Expr:
    a = lift(a, type)
    if a.type == type:
        return a
    if isinstance(a, Const):
        return const(a.value, type) if type not in FLOAT_TYPES or math.isfinite(a.value) else Const(a.value, type)
    return Cast(a, type)


def fma(a, b, c) -> Expr:
    t = next(x.type for x in (a, b, c) if isinstance(x, Expr))
    return Fma(lift(a, t), lift(b, t), lift(c, t), t)


def _type_of(x) -> str:
    return x.type if isinstance(x, Expr) else "f32"


def lt(a, b): return binary("lt", a, b)
def le(a, b): return binary("le", a, b)
def gt(a, b): return binary("gt", a, b)
def ge(a, b): return binary("ge", a, b)
def eq(a, b): return binary("eq", a, b)
def ne(a, b): return binary("ne", a, b)
def minimum(a, b): return binary("min", a, b)
def maximum(a, b): return binary("max", a, b)
def logical_and(a, b): return binary("and", a, b)
def logical_or(a, b): return binary("or", a, b)


def all_of(conds) -> Expr | Const:
    """The conjunction of 0/1 conditions (true when there are none)."""
    result: Expr | None = None
    for c in conds:
        result = c if result is None else logical_and(result, c)
    return result if result is not None else const(1, "i32")


def in_range(index, extent: int) -> Expr:
    """0 <= index < extent."""
    return logical_and(ge(index, 0), lt(index, extent))


def _fold_binary(op: str, a: Expr, b: Expr) -> Expr | None:
    ca = a.value if isinstance(a, Const) else None
    cb = b.value if isinstance(b, Const) else None
    integer = a.type not in FLOAT_TYPES
    if integer and ca is not None and cb is not None and op in ("add", "sub", "mul", "min", "max"):
        value = {"add": ca + cb, "sub": ca - cb, "mul": ca * cb, "min": min(ca, cb), "max": max(ca, cb)}[op]
        return const(value, a.type)
    # Neutral elements are exact in both integer and IEEE arithmetic (x + 0 keeps -0.0 only for
    # integers, so the float case folds just multiplication by one).
    if op == "add" and integer:
        if ca == 0:
            return b
        if cb == 0:
            return a
    if op == "sub" and integer and cb == 0:
        return a
    if op == "mul":
        if cb == 1:
            return a
        if ca == 1:
            return b
        if integer and (ca == 0 or cb == 0):
            return const(0, a.type)
    if op == "div" and cb == 1:
        return a
    return None


# -- analysis ------------------------------------------------------------------------------------

def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Load):
        return (e.index,)
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, (Unary, Cast)):
        return (e.a,)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, Fma):
        return (e.a, e.b, e.c)
    return ()


def walk(e: Expr):
    stack = [e]
    while stack:
        x = stack.pop()
        yield x
        stack.extend(children(x))


def uses(e: Expr, var: Var | Local) -> bool:
    return any(x is var for x in walk(e))
