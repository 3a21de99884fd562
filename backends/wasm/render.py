"""Loop nests -> WAT text.

The module owns one memory (exported as `memory`) laid out by the memory plan, one function per
kernel and an exported `run` that calls them in order. By default weights live in active data
segments at their planned offsets, which wasmtime maps copy-on-write from the native-code file (no
copy at load). With `bulk-memory` they are passive segments that a start function copies in with
`memory.init` and drops: one copy per load, for engines that would otherwise keep the module's
bytes and the weights twice. With `external_weights` the module holds no weights at all: they sit in
content-addressed files (`weights_files.py`) that the device writes in at load. Segment contents are left empty here and filled in by `assemble` straight into the binary, so a model's megabytes of weights never pass through WAT text.
Innermost loops the vectoriser accepts are rendered with SIMD128 (see `vectorize`).
"""

from __future__ import annotations

from backends.wasm import mathlib
from backends.wasm.intrinsics import render_intrinsic
from backends.wasm.kernel_parts import CONTROL_BYTES, loop_split, render_runtime, threads_control
from backends.wasm.options import WasmOptions
from backends.wasm.vectorize import VectorRenderer, vectorizable
from ir.loops.expr import (FLOAT_TYPES, MATH_UNARY, Binary, Cast, Const, Expr, Fma, Load, Local, Select, Unary,
                           Var)
from ir.loops.program import WEIGHT, Assign, If, Intrinsic, Kernel, Loop, Program, Stmt, Store

PAGE = 65536

LOAD = {"float32": "f32.load", "float64": "f64.load", "float16": "i32.load16_u", "bfloat16": "i32.load16_u", "int8": "i32.load8_s",
        "uint8": "i32.load8_u", "bool": "i32.load8_u", "int16": "i32.load16_s", "uint16": "i32.load16_u",
        "int32": "i32.load", "uint32": "i64.load32_u", "int64": "i64.load", "uint64": "i64.load"}
STORE = {"float32": "f32.store", "float64": "f64.store", "float16": "i32.store16", "bfloat16": "i32.store16", "int8": "i32.store8",
         "uint8": "i32.store8", "bool": "i32.store8", "int16": "i32.store16", "uint16": "i32.store16",
         "int32": "i32.store", "uint32": "i64.store32", "int64": "i64.store", "uint64": "i64.store"}
SHIFT = {1: 0, 2: 1, 4: 2, 8: 3}

_FLOAT_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "min": "min", "max": "max",
                 "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne"}
_INT_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div_s", "rem": "rem_s", "and": "and",
               "or": "or", "xor": "xor", "shl": "shl", "shr": "shr_u", "sar": "shr_s", "lt": "lt_s", "le": "le_s",
               "gt": "gt_s", "ge": "ge_s", "eq": "eq", "ne": "ne"}
_FLOAT_UNARY = ("neg", "abs", "sqrt", "floor", "ceil", "trunc", "nearest")

_CASTS = {
    ("f32", "f64"): "f64.promote_f32", ("f64", "f32"): "f32.demote_f64",
    ("i32", "i64"): "i64.extend_i32_s", ("i64", "i32"): "i32.wrap_i64",
    ("i32", "f32"): "f32.convert_i32_s", ("i32", "f64"): "f64.convert_i32_s",
    ("i64", "f32"): "f32.convert_i64_s", ("i64", "f64"): "f64.convert_i64_s",
    ("f32", "i32"): "i32.trunc_sat_f32_s", ("f64", "i32"): "i32.trunc_sat_f64_s",
    ("f32", "i64"): "i64.trunc_sat_f32_s", ("f64", "i64"): "i64.trunc_sat_f64_s",
}


def render_module(program: Program, options: WasmOptions, memory_bytes: int) -> tuple[str, dict | None]:
    """The module's WAT and, where it splits contractions into parts on threads, what the device
    needs to run them: {"parts": the table's length, "control": the control block's offset,
    "pages": the shared memory's fixed size}; else None."""
    renderer = WatRenderer(program, options)
    wat = renderer.module(memory_bytes)
    if not renderer.parts_table:
        return wat, None
    control = threads_control(memory_bytes)
    return wat, {"parts": len(renderer.parts_table), "control": control,
                 "pages": max(1, -(-(control + CONTROL_BYTES) // PAGE))}


class WatRenderer:
    def __init__(self, program: Program, options: WasmOptions):
        self.program = program
        self.options = options
        self.math_used: set[str] = set()
        self._depth_names: dict[int, str] = {}   # Var uid -> local name (by nesting depth)
        self._max_depth = 0
        self._kernel_name = ""
        self.intrinsic_funcs: list[str] = []
        self.parts_table: list[str] = []     # the parts of split contractions, called by index (kernel_parts.py)
        self._outer_range: tuple[int, int, int] | None = None    # a kernel part: (start, stop, depth) of its loop cut

    # -- module --------------------------------------------------------------------------------
    def module(self, memory_bytes: int) -> str:
        # External weights (`--external-weights`) are written into memory by the device at load.
        weights = [] if self.options.external_weights else \
            [s for s in self.program.storages if s.kind == WEIGHT and s.nbytes]
        funcs, calls = [], []
        for k in self.program.kernels:
            split = loop_split(k, self.options.kernel_parts, self._vectorized) if self.options.threads else None
            if split is None:
                funcs.append(self.kernel(k))
                calls.append(f"    (call ${_ident(k.name)})")
                continue
            calls.append(f"    (call $fork (i32.const {len(self.parts_table)}) (i32.const {split.parts}))")
            for p, bounds in enumerate(split.bounds):
                funcs.append(self.kernel(k, part=(p, bounds, split.depth)))
                self.parts_table.append(f"{_ident(k.name)}_part{p}")
        control = threads_control(memory_bytes) if self.parts_table else None
        pages = max(1, -(-(memory_bytes if control is None else control + CONTROL_BYTES) // PAGE))
        if control is not None:
            # Split contractions: a shared memory every thread's instance imports, of a fixed size.
            lines = ["(module", f'  (memory (export "memory") (import "env" "memory") {pages} {pages} shared)',
                     render_runtime(control).rstrip("\n"),
                     f"  (table {len(self.parts_table)} funcref)",
                     "  (elem (i32.const 0) func " + " ".join(f"${n}" for n in self.parts_table) + ")"]
        else:
            # Under --memory shared the module imports the model's one memory (and still exports it).
            imported = ' (import "env" "memory")' if self.options.shared_layout is not None else ""
            lines = ["(module", f'  (memory (export "memory"){imported} {pages})']
        if self.options.bulk_memory and weights:
            # Passive segments, copied in once by the start function and then dropped, so an engine
            # that keeps the module's bytes (a browser) can free its copy of the weights.
            lines += [f"  (data ${_ident(s.name)} \"\")" for s in weights]
            init = [f"    (memory.init ${_ident(s.name)} (i32.const {s.offset}) (i32.const 0) (i32.const {s.nbytes}))"
                    f" (data.drop ${_ident(s.name)})" for s in weights]
            lines += ["  (func $load_weights", *init, "  )", "  (start $load_weights)"]
        else:
            lines += [f"  (data (i32.const {s.offset}) \"\") ;; {s.name}" for s in weights]
        lines += funcs
        lines += [_indent(f, "  ") for f in self.intrinsic_funcs]
        lines.append('  (func (export "run")\n' + "\n".join(calls) + "\n  )")
        helpers = mathlib.render_functions(self.math_used, fused=self.options.relaxed_simd)
        if helpers:
            lines.append(_indent(helpers, "  "))
        lines.append(")")
        return "\n".join(lines) + "\n"

    def _vectorized(self, loop: Loop) -> bool:
        return self.options.vectorize and vectorizable(loop)

    def kernel(self, kernel: Kernel, part: tuple[int, tuple[int, int], int] | None = None) -> str:
        """The kernel's function; with `part` (p, (start, stop), depth), part p of it: its loop at
        `depth` over [start, stop) only, named `<kernel>_part<p>` (kernel_parts.loop_split)."""
        self._depth_names, self._max_depth = {}, 0
        self._outer_range = None if part is None else (*part[1], part[2])
        self._kernel_name = _ident(kernel.name) + ("" if part is None else f"_part{part[0]}")
        # Named by position in the kernel, not by object identity: builds stay byte-identical.
        self._local_names = {loc.uid: f"${_ident(loc.name)}{i}" for i, loc in enumerate(kernel.locals)}
        self._vector_locals = 0
        body = self.stmts(kernel.body, depth=0, indent="    ")
        decls = [f"(local $d{d} i32)" for d in range(self._max_depth)]
        decls += [f"(local {self._local_names[loc.uid]} {loc.type})" for loc in kernel.locals]
        decls += [f"(local $v{i} v128)" for i in range(self._vector_locals)]
        header = f"  (func ${self._kernel_name} ;; {kernel.op_type}"
        return "\n".join([header, *(f"    {d}" for d in decls), body, "  )"])

    # -- statements ----------------------------------------------------------------------------
    def stmts(self, stmts: list[Stmt], depth: int, indent: str) -> str:
        return "\n".join(self.stmt(s, depth, indent) for s in stmts)

    def stmt(self, s: Stmt, depth: int, indent: str) -> str:
        if isinstance(s, Store):
            return indent + self.store(s)
        if isinstance(s, Assign):
            return f"{indent}(local.set {self._local_names[s.local.uid]} {self.expr(s.value)})"
        if isinstance(s, If):
            text = f"{indent}(if {self.expr(s.cond)}\n{indent}  (then\n{self.stmts(s.body, depth, indent + '    ')})"
            if s.orelse:
                text += f"\n{indent}  (else\n{self.stmts(s.orelse, depth, indent + '    ')})"
            return text + ")"
        if isinstance(s, Loop):
            return self.loop(s, depth, indent)
        if isinstance(s, Intrinsic):
            name = f"{self._kernel_name}_{s.name}{len(self.intrinsic_funcs)}"
            self.intrinsic_funcs.append(render_intrinsic(s, name, self.options, self.parts_table).strip())
            return f"{indent}(call ${name})"
        raise TypeError(f"unknown statement {s!r}")

    def loop(self, loop: Loop, depth: int, indent: str) -> str:
        if loop.extent <= 0:
            return f"{indent};; empty loop"
        var = f"$d{depth}"
        self._depth_names[loop.var.uid] = var
        self._max_depth = max(self._max_depth, depth + 1)
        start, stop = (0, loop.extent) if self._outer_range is None or depth != self._outer_range[2] \
            else self._outer_range[:2]
        if self.options.vectorize and vectorizable(loop):
            return VectorRenderer(self, loop, var).render(indent, start, stop)
        body = self.stmts(loop.body, depth + 1, indent + "  ")
        return self.counted_loop(var, start, stop, 1, [body], indent)

    def vector_local(self) -> str:
        """A fresh v128 local of the kernel being rendered."""
        self._vector_locals += 1
        return f"$v{self._vector_locals - 1}"

    def local_name(self, loc: Local) -> str:
        return self._local_names[loc.uid]

    def counted_loop(self, var: str, start: int, stop: int, step: int, bodies: list[str], indent: str) -> str:
        """`for var in range(start, stop, step)`, each trip running `bodies` (var advances by
        `step` after each body). Nothing when the range is empty; no loop for a single trip."""
        trips = (stop - start) // (step * len(bodies))
        if trips <= 0:
            return ""
        lines = [f"{indent}(local.set {var} (i32.const {start}))"]
        advance = f"{indent}  (local.set {var} (i32.add (local.get {var}) (i32.const {step})))"
        if trips == 1:
            for body in bodies:
                lines += [body, advance]
            return "\n".join(lines)
        lines.append(f"{indent}(loop")
        for body in bodies:
            lines += [body, advance]
        lines.append(f"{indent}  (br_if 0 (i32.lt_u (local.get {var}) (i32.const {start + trips * step * len(bodies)}))))")
        return "\n".join(lines)

    def store(self, s: Store) -> str:
        storage = s.buffer.storage
        value = self.expr(s.value)
        if storage.dtype in ("float16", "bfloat16"):
            fn = "f32_to_f16" if storage.dtype == "float16" else "f32_to_bf16"
            self.math_used.add(fn)
            value = f"(call ${fn} {value})"
        return f"({STORE[storage.dtype]} offset={storage.offset} {self.address(s.buffer, s.index)} {value})"

    def address(self, buffer, index: Expr) -> str:
        shift = SHIFT[buffer.storage.itemsize]
        idx = self.expr(index)
        return f"(i32.shl {idx} (i32.const {shift}))" if shift else idx

    # -- expressions ---------------------------------------------------------------------------
    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            return f"({e.type}.const {_number(e.value, e.type)})"
        if isinstance(e, Var):
            return f"(local.get {self._depth_names[e.uid]})"
        if isinstance(e, Local):
            return f"(local.get {self._local_names[e.uid]})"
        if isinstance(e, Load):
            storage = e.buffer.storage
            text = f"({LOAD[storage.dtype]} offset={storage.offset} {self.address(e.buffer, e.index)})"
            if storage.dtype == "float16":
                self.math_used.add("f16_to_f32")
                text = f"(call $f16_to_f32 {text})"
            elif storage.dtype == "bfloat16":    # bfloat16 is the top half of a float32
                text = f"(f32.reinterpret_i32 (i32.shl {text} (i32.const 16)))"
            return text
        if isinstance(e, Binary):
            return self.binary(e)
        if isinstance(e, Unary):
            return self.unary(e)
        if isinstance(e, Select):
            return f"(select {self.expr(e.a)} {self.expr(e.b)} {self.expr(e.cond)})"
        if isinstance(e, Cast):
            return self.cast(e)
        if isinstance(e, Fma):
            t = e.type
            return f"({t}.add ({t}.mul {self.expr(e.a)} {self.expr(e.b)}) {self.expr(e.c)})"
        raise TypeError(f"unknown expression {e!r}")

    def binary(self, e: Binary) -> str:
        t = e.a.type
        a, b = self.expr(e.a), self.expr(e.b)
        if t in FLOAT_TYPES:
            if e.op in _FLOAT_BINARY:
                return f"({t}.{_FLOAT_BINARY[e.op]} {a} {b})"
            if e.op in ("pow", "rem"):
                fn = "pow" if e.op == "pow" else "fmod"
                return self.call_f64(fn, t, a, b)
        else:
            if e.op in _INT_BINARY:
                return f"({t}.{_INT_BINARY[e.op]} {a} {b})"
            if e.op in ("min", "max"):
                cmp = "lt_s" if e.op == "min" else "gt_s"
                return f"(select {a} {b} ({t}.{cmp} {a} {b}))"
        raise TypeError(f"no WebAssembly rendering of {e.op} on {t}")

    def unary(self, e: Unary) -> str:
        t = e.a.type
        a = self.expr(e.a)
        if e.op == "reinterpret":
            return f"({e.type}.reinterpret_{t} {a})"
        if t in FLOAT_TYPES:
            if e.op in _FLOAT_UNARY:
                return f"({t}.{e.op} {a})"
            if e.op == "isnan":
                return f"({t}.ne {a} {a})"
            if e.op in ("isinf_pos", "isinf_neg"):
                return f"({t}.eq {a} ({t}.const {'-' if e.op == 'isinf_neg' else ''}inf))"
            if e.op in MATH_UNARY:
                return self.call_f64(e.op, t, a)
        else:
            if e.op == "neg":
                return f"({t}.sub ({t}.const 0) {a})"
            if e.op == "abs":
                return f"(select {a} ({t}.sub ({t}.const 0) {a}) ({t}.ge_s {a} ({t}.const 0)))"
            if e.op == "not":
                return f"({t}.eqz {a})" if t == "i32" else f"(i64.extend_i32_u (i64.eqz {a}))"
            if e.op in ("floor", "ceil", "trunc", "nearest"):
                return a
        raise TypeError(f"no WebAssembly rendering of {e.op} on {t}")

    def call_f64(self, fn: str, t: str, *args: str) -> str:
        self.math_used.add(fn)
        if t == "f64":
            return f"(call ${fn} {' '.join(args)})"
        promoted = " ".join(f"(f64.promote_f32 {a})" for a in args)
        return f"(f32.demote_f64 (call ${fn} {promoted}))"

    def cast(self, e: Cast) -> str:
        a = self.expr(e.a)
        return f"({_CASTS[(e.a.type, e.type)]} {a})"


def _number(value, type: str) -> str:
    if type in FLOAT_TYPES:
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return float(value).hex() if type == "f64" else _f32_hex(value)
    return str(int(value))


def _f32_hex(value: float) -> str:
    import numpy as np
    return float(np.float32(value)).hex()


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in name)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())
