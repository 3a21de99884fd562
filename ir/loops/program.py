"""Statements, buffers and programs of the loop-nest IR.

A `Storage` is one allocation (an input, an output, a weight or a temporary); a `Buffer` is a
row-major view of a storage with a shape, so a Reshape is a new view of the same storage and costs
nothing. A `Program` is what one computation unit compiles to: its storages and one `Kernel` per
node, each a list of statements (loops, stores, accumulator assignments, guarded blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ir.loops.expr import Expr, Load, Local, Var, lift, walk

# Storage dtypes (numpy names) and the compute type each widens to.
COMPUTE_TYPE = {
    "float32": "f32", "float64": "f64", "float16": "f32", "bfloat16": "f32",
    "int8": "i32", "uint8": "i32", "int16": "i32", "uint16": "i32", "int32": "i32", "bool": "i32",
    "uint32": "i64", "int64": "i64", "uint64": "i64",
}

INPUT, OUTPUT, WEIGHT, TEMP = "input", "output", "weight", "temp"


@dataclass(eq=False)
class Storage:
    name: str
    dtype: str                       # numpy dtype name
    numel: int
    kind: str                        # INPUT, OUTPUT, WEIGHT or TEMP
    data: bytes | None = None        # weights only: the little-endian contents
    offset: int | None = None        # byte offset, set by the memory planner

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(eq=False)
class Buffer:
    storage: Storage
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def compute_type(self) -> str:
        return COMPUTE_TYPE[self.storage.dtype]

    @property
    def strides(self) -> tuple[int, ...]:
        strides, step = [], 1
        for d in reversed(self.shape):
            strides.append(step)
            step *= d
        return tuple(reversed(strides))

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def flat_index(self, index) -> Expr:
        index = tuple(index)
        if len(index) != len(self.shape):
            raise ValueError(f"{self.name}: {len(index)} indices for rank {len(self.shape)}")
        flat = lift(0, "i32")
        for i, stride, dim in zip(index, self.strides, self.shape):
            if dim != 1:
                flat = flat + lift(i, "i32") * stride
        return flat

    def __getitem__(self, index) -> Expr:
        if not isinstance(index, tuple):
            index = (index,)
        return Load(self, self.flat_index(index))

    def at(self, flat: Expr) -> Expr:
        """Load by flat element index."""
        return Load(self, lift(flat, "i32"))

    def view(self, shape) -> Buffer:
        shape = tuple(int(d) for d in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.storage.numel:
            raise ValueError(f"{self.name}: cannot view {self.storage.numel} elements as {shape}")
        return Buffer(self.storage, shape)


class Stmt:
    """A statement. Analyses walk statements through three questions every kind answers, so a new
    kind of statement is taught to them once, here, rather than in each backend's walker."""

    def exprs(self) -> tuple[Expr, ...]:
        """The expressions this statement itself evaluates (not those of nested statements)."""
        return ()

    def blocks(self) -> tuple[list[Stmt], ...]:
        """The statement lists nested directly inside this one."""
        return ()

    def buffers(self) -> tuple[Buffer, ...]:
        """The buffers this statement accesses other than through a `Load` in its expressions."""
        return ()


@dataclass(eq=False)
class Loop(Stmt):
    var: Var
    extent: int
    body: list[Stmt] = field(default_factory=list)

    def blocks(self) -> tuple[list[Stmt], ...]:
        return (self.body,)


@dataclass(eq=False)
class Store(Stmt):
    buffer: Buffer
    index: Expr                      # flat element index
    value: Expr

    def exprs(self) -> tuple[Expr, ...]:
        return (self.index, self.value)

    def buffers(self) -> tuple[Buffer, ...]:
        return (self.buffer,)


@dataclass(eq=False)
class Assign(Stmt):
    local: Local
    value: Expr

    def exprs(self) -> tuple[Expr, ...]:
        return (self.value,)


@dataclass(eq=False)
class If(Stmt):
    cond: Expr
    body: list[Stmt] = field(default_factory=list)
    orelse: list[Stmt] = field(default_factory=list)

    def exprs(self) -> tuple[Expr, ...]:
        return (self.cond,)

    def blocks(self) -> tuple[list[Stmt], ...]:
        return (self.body, self.orelse)


@dataclass(eq=False)
class Intrinsic(Stmt):
    """A call to a kernel the target provides ready-made (a GEMM, a convolution), chosen by a
    lowering only when the target offers one for `spec` (`LoopBuilder.offers`): `spec` says what is
    computed (a frozen spec of `ir/loops/contraction.py`), `operands` the buffers it reads and
    writes (anything with a `buffers()` method, e.g. `ContractionOperands`)."""
    spec: object
    operands: object

    @property
    def name(self) -> str:
        return self.spec.kind

    def buffers(self) -> tuple[Buffer, ...]:
        return self.operands.buffers()


@dataclass(eq=False)
class Kernel:
    """The statements one node lowers to (one function in the rendered module)."""
    name: str
    op_type: str
    body: list[Stmt] = field(default_factory=list)
    locals: list[Local] = field(default_factory=list)


@dataclass(eq=False)
class Program:
    storages: list[Storage] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    inputs: dict[str, Buffer] = field(default_factory=dict)     # graph input name -> buffer
    outputs: dict[str, Buffer] = field(default_factory=dict)    # graph output name -> buffer
    # bounded input or output name -> (its bounded axis, its length companion: one int32 the
    # host writes for an input and reads for an output; see ir/bounds.py)
    bounds: dict[str, tuple[int, Buffer]] = field(default_factory=dict)


def walk_stmts(stmts):
    """Every statement of `stmts` and of the blocks nested in them, each before its children."""
    for s in stmts:
        yield s
        for block in s.blocks():
            yield from walk_stmts(block)


def exprs_in(stmts):
    """The top of every expression evaluated anywhere in `stmts`, statement by statement."""
    for s in walk_stmts(stmts):
        yield from s.exprs()


def loads_in(stmts):
    """Every `Load` anywhere in the expressions of `stmts`."""
    for e in exprs_in(stmts):
        yield from (x for x in walk(e) if isinstance(x, Load))


def buffers_accessed(stmts):
    """Every buffer `stmts` read or write, in statement order (a buffer may come more than once):
    for each statement its own buffers, then those its expressions load from."""
    for s in walk_stmts(stmts):
        yield from s.buffers()
        for e in s.exprs():
            yield from (x.buffer for x in walk(e) if isinstance(x, Load))
