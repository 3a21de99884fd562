"""The loop-nest IR: what every code-generating backend (WebAssembly, CUDA) consumes.

`expr` holds scalar expressions, `program` the statements and buffers, `builder` the `LoopBuilder`
that op lowerings (registered as `@lowering("loops", ...)` next to each op in `ir/ops/`) write with.
`codegen.lower.lower_graph` drives it; this package knows no op and imports no pass.
"""

from ir.loops.builder import BACKEND, LoopBuilder, broadcast_load
from ir.loops.expr import (Binary, Cast, Const, Expr, Fma, Load, Local, Select, Unary, Var, binary, cast, const,
                           eq, fma, ge, gt, le, lift, logical_and, logical_or, lt, maximum, minimum, ne,
                           select, unary)
from ir.loops.program import (COMPUTE_TYPE, INPUT, OUTPUT, TEMP, WEIGHT, Assign, Buffer, If, Intrinsic, Kernel, Loop,
                              Program, Stmt, Storage, Store, buffers_accessed, exprs_in, loads_in,
                              walk_stmts)

__all__ = [name for name in dir() if not name.startswith("_")]
