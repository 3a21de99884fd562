"""Loop nests -> one CUDA C++ translation unit per computation unit.

Every top-level loop nest of a node's loop-nest kernel becomes one `extern "C" __global__` function:
the loops `parallelize` proves independent become the thread index (one thread per output cell,
256 threads a block), the rest run inside each thread in their original order. A nest that cannot be
proven parallel runs as one thread, which is always correct. Launches run in order on one stream, so
a nest sees everything the nests before it wrote.

All kernels of a CU share one parameter layout: one pointer per CU input and output, then the
weights (one blob uploaded once, `cu-NNNN.weights`) and the scratch space for temporaries. The same
source runs on a GPU and, unchanged, under cuda-sim.

Temporaries share the scratch space by lifetime (`codegen.memory_plan`), measured in launches: a
temporary lives from the first launch that touches it to the last, so everything one launch
touches, whichever of its fused kernels touches it, is alive at once and gets bytes of its own
(its threads run together), while a temporary dead before a later launch starts lends it its bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from backends.cuda.fuse import Unit, fuse_elementwise
from backends.cuda.kernels import launches as contraction_launches
from backends.cuda.kernels import render_kernel as render_contraction
from codegen.parallel_loops import ParallelNest, plan_parallel
from backends.cuda.spelling import (C_COMPUTE, C_STORAGE, NARROW, PRELUDE, WIDEN, binary, cast, combine, identity, number,
                                     unary)
from backends.cuda.tensor_cores import HEADERS, choose_precision, launch_geometry, render_wmma_function
from backends.cuda.tiled import TILE, TiledContraction, plan_tiled
from backends.cuda.warp_rows import StridedLoop, plan_warp_rows
from codegen.memory_plan import place_temporaries
from ir.bounds import length_name
from ir.errors import UnsupportedError
from ir.loops.expr import (FLOAT_TYPES, Binary, Cast, Const, Expr, Fma, Load, Local, Select, Unary, Var, walk)
from ir.loops.program import (INPUT, OUTPUT, TEMP, WEIGHT, Assign, If, Intrinsic, Kernel, Loop, Program, Stmt,
                              Store, buffers_accessed, walk_stmts)

BLOCK_THREADS = 256
# cudaMalloc's alignment, for weights and each temporary in the scratch space alike: a tensor starts
# where its own allocation would, aligned for any vector load and on a 128-byte line, so sharing the
# scratch space never makes a kernel's accesses less coalesced than separate buffers would.
ALIGN = 256


@dataclass
class Launch:
    kernel: str
    node_kernel: str          # the loop-nest kernel (one per node) it comes from
    op_type: str
    grid: int | list[int]     # blocks (x or [x, y, z])
    block: int | list[int]
    threads: int              # the useful threads; edge blocks check the bounds


@dataclass
class Param:
    name: str
    kind: str                 # input, output, length, weights, scratch
    dtype: str = "uint8"
    shape: list[int] = field(default_factory=list)
    bytes: int = 0


@dataclass
class CudaSource:
    text: str
    launches: list[Launch]
    params: list[Param]
    weights: bytes
    scratch_bytes: int
    tensor_cores: dict[str, str] = field(default_factory=dict)   # kernel -> precision of its inputs
    weight_segments: list[tuple[int, int]] = field(default_factory=list)   # (offset, bytes) of each weight

    @property
    def kernel_names(self) -> list[str]:
        return [launch.kernel for launch in self.launches]


def _align(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN


def render_cuda(program: Program, prefix: str = "k", *, tiled: bool = True, epilogues: bool = True,
                precision: str = "exact", tensor_core_tile: str = "auto") -> CudaSource:
    """`tiled=False`: contractions stay one thread per output (no shared-memory tiles, hence no
    epilogues either); `epilogues=False`: they are tiled but the maps after them keep their own
    launches. Both exist to compare a build against the plainer one (tests, and when in doubt).
    `precision` (tf32, fp16, bf16): tiled contractions large enough run on tensor cores with their
    inputs rounded to it (`tensor_cores`), on the block tiling `tensor_core_tile` names (tensor_cores.TILES)."""
    return CudaRenderer(program, prefix, tiled=tiled, epilogues=epilogues, precision=precision,
                        tensor_core_tile=tensor_core_tile).render()


class CudaRenderer:
    def __init__(self, program: Program, prefix: str, *, tiled: bool = True, epilogues: bool = True,
                 precision: str = "exact", tensor_core_tile: str = "auto"):
        self.program = program
        self.precision = precision
        self.tensor_core_tile = tensor_core_tile
        self.tensor_cores: dict[str, str] = {}
        self.tiled = tiled
        self.epilogues = tiled and epilogues
        self.prefix = re.sub(r"\W", "_", prefix)
        self.address: dict[int, str] = {}      # id(storage) -> C expression of its base pointer
        self.weight_blob = bytearray()
        self.weight_segments: list[tuple[int, int]] = []
        self.scratch = 0
        self.params: list[Param] = []
        self.launches: list[Launch] = []
        self._names: dict[int, str] = {}       # var / local uid -> C name
        # id(storage) -> the register that holds its value at the thread's own cell, in an epilogue
        self._registers: dict[int, str] = {}

    # -- memory --------------------------------------------------------------------------------
    def layout(self) -> None:
        for kind, binding in ((INPUT, self.program.inputs), (OUTPUT, self.program.outputs)):
            for name, buf in binding.items():
                self.address[id(buf.storage)] = f"p{len(self.params)}"
                self.params.append(Param(name, kind, buf.dtype, list(buf.shape), buf.storage.nbytes))
        # A bounded input's or output's length (ir/bounds.py): one int32 the host writes or reads.
        for name, (_, companion) in self.program.bounds.items():
            self.address[id(companion.storage)] = f"p{len(self.params)}"
            self.params.append(Param(length_name(name), "length", "int32", [1], companion.storage.nbytes))
        for storage in self.program.storages:
            if id(storage) in self.address:
                continue
            if storage.dtype not in C_STORAGE:
                raise UnsupportedError(f"tensor {storage.name!r} has dtype {storage.dtype}, which the CUDA backend does not support yet")
            if storage.kind == WEIGHT:
                self.address[id(storage)] = f"(weights + {len(self.weight_blob)})"
                data = storage.data or b""
                if data:
                    self.weight_segments.append((len(self.weight_blob), len(data)))
                self.weight_blob += data + b"\0" * (_align(len(data)) - len(data))
            elif storage.kind != TEMP:       # temporaries are placed once the launches are known
                raise UnsupportedError(f"tensor {storage.name!r} ({storage.kind}) is not bound to a CU input or output")
        self.params.append(Param("weights", "weights", bytes=len(self.weight_blob)))

    def place_scratch(self, launches: list[Unit]) -> None:
        """Temporaries in the scratch space, one lifetime step per launch (a fused unit is one)."""
        steps = [[s for part in unit.parts for s in part.stmts] for unit in launches]
        plan = place_temporaries(self.program, ALIGN, steps)
        for storage, offset in plan.offsets.items():
            self.address[id(storage)] = f"(scratch + {offset})"
        self.scratch = plan.arena_bytes
        self.params.append(Param("scratch", "scratch", bytes=self.scratch))

    # -- module --------------------------------------------------------------------------------
    def render(self) -> CudaSource:
        self.layout()
        units = []
        for index, kernel in enumerate(self.program.kernels):
            units += self.units(index, kernel)
        launches = fuse_elementwise(units, epilogues=self.epilogues)
        self.place_scratch(launches)
        functions = [self.emit(unit) for unit in launches]
        prelude = PRELUDE + (HEADERS if self.tensor_cores else "")
        return CudaSource(prelude + "\n" + "\n".join(functions), self.launches, self.params,
                          bytes(self.weight_blob), self.scratch, self.tensor_cores, self.weight_segments)

    def units(self, index: int, kernel: Kernel) -> list[Unit]:
        """The launches one node's kernel needs: a parallel nest each, serial statements grouped."""
        base = f"{self.prefix}{index:03d}_{re.sub(r'[^A-Za-z0-9]', '', kernel.op_type)}"
        statements = [s for s in kernel.body if not (isinstance(s, Loop) and s.extent <= 0)]
        # A local that lives across top-level statements would need to survive between launches:
        # such a kernel runs as one serial launch.
        groups: list[tuple[ParallelNest | None, list[Stmt]]] = []
        if any(isinstance(s, Intrinsic) for s in statements):   # a ready-made kernel (kernels.py) is its node's whole body
            groups = [(None, statements)]
        elif _locals_cross_statements(statements):
            groups = [(None, statements)] if statements else []
        else:
            for s in statements:
                nest = plan_parallel(s)
                if nest is None and groups and groups[-1][0] is None:
                    groups[-1][1].append(s)
                else:
                    groups.append((nest, [s]))
        return [Unit(base if len(groups) == 1 else f"{base}_{part}", kernel, nest, stmts)
                for part, (nest, stmts) in enumerate(groups)]

    def emit(self, unit: Unit) -> str:
        kernel, nest, name = unit.kernel, unit.nest, unit.name
        # A launch names every node kernel it runs (one, unless maps were fused into it).
        node_kernels = "+".join(p.kernel.name for p in unit.parts)
        op_types = "+".join(p.kernel.op_type for p in unit.parts)
        if isinstance(unit.stmts[0], Intrinsic):
            for launch in contraction_launches(name, unit.stmts[0].spec):
                self.launches.append(Launch(launch[0], node_kernels, op_types, *launch[1:]))
            return render_contraction(self, unit, unit.stmts[0])
        tiled = plan_tiled(nest) if self.tiled else None
        if unit.fused and tiled is None:
            threads = nest.thread_count
            block = min(BLOCK_THREADS, -(-threads // 32) * 32)
            self.launches.append(Launch(name, node_kernels, op_types, -(-threads // block), block, threads))
            return self.fused_function(unit)
        precision = choose_precision(tiled, self.precision)
        if tiled is not None and precision != "exact":
            grid, block = launch_geometry(tiled, self.tensor_core_tile)
            m, n, b = (tiled.extent(x) for x in (tiled.rows, tiled.cols, tiled.batch))
            self.launches.append(Launch(name, node_kernels, op_types, grid, block, m * n * b))
            self.tensor_cores[name] = precision
            return render_wmma_function(self, unit, tiled, precision, self.tensor_core_tile)
        if tiled is not None:
            m, n, b = (tiled.extent(x) for x in (tiled.rows, tiled.cols, tiled.batch))
            self.launches.append(Launch(name, node_kernels, op_types, [-(-n // TILE), -(-m // TILE), b],
                                        [TILE, TILE, 1], m * n * b))
            return self.tiled_function(unit, tiled)
        rows = plan_warp_rows(nest)
        threads = (nest.thread_count * (32 if rows else 1)) if nest else 1
        block = min(BLOCK_THREADS, -(-threads // 32) * 32) if nest else 1
        self.launches.append(Launch(name, node_kernels, op_types, -(-threads // block), block, threads))
        return self.function(name, kernel, nest, unit.stmts, rows)

    def fused_function(self, unit: Unit) -> str:
        """Consecutive elementwise nests over the same threads, one after the other in each thread."""
        self._names = {}
        parts = unit.parts
        stmts = [s for p in parts for s in p.stmts]
        lines = self.header(unit.name, unit.kernel, stmts, BLOCK_THREADS)
        lines[1] = "  // fused: " + ", ".join(f"{p.kernel.op_type} ({p.kernel.name})" for p in parts)
        head = [loop for loop in unit.nest.threads if loop.extent > 1]
        lines.append("  long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;")
        lines.append(f"  if (tid >= {unit.nest.thread_count}LL) return;")
        lines += self.decompose("tid", head, "  ")
        for part in parts:
            lines += self.bind_threads(part, head, "tid")
            lines += self.stmts(part.nest.body, "  ")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def function(self, name: str, kernel: Kernel, nest: ParallelNest | None, stmts: list[Stmt],
                 rows: dict[int, StridedLoop] | None = None) -> str:
        self._names = {}
        lines = self.header(name, kernel, stmts, BLOCK_THREADS)
        used_locals = _locals_in(stmts)
        for loc in kernel.locals:
            if loc.uid in used_locals:
                lines.append(f"  {C_COMPUTE[loc.type]} {self.local_name(loc)};")
        indent = "  "
        body = stmts
        if nest is None:
            lines.append("  if (blockIdx.x != 0 || threadIdx.x != 0) return;  // a serial nest: one thread")
        elif rows is not None:
            lines.append("  long long tid = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // one warp a row")
            lines.append("  const int lane = threadIdx.x & 31;")
            lines.append(f"  if (tid >= {nest.thread_count}LL) return;  // whole warps leave together")
        else:
            lines.append("  long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;")
            lines.append(f"  if (tid >= {nest.thread_count}LL) return;")
        if nest is not None:
            for depth, loop in enumerate(reversed(nest.threads)):
                var = self.var_name(loop.var)
                lines.append(f"  const int {var} = (int)(tid % {loop.extent});")
                if depth + 1 < len(nest.threads):
                    lines.append(f"  tid /= {loop.extent};")
            for loop in nest.serial:
                var = self.var_name(loop.var)
                lines.append(f"{indent}for (int {var} = 0; {var} < {loop.extent}; ++{var}) {{")
                indent += "  "
            body = nest.body
        lines += self.warp_row(body, rows, indent) if rows is not None else self.stmts(body, indent)
        if nest is not None:
            for _ in nest.serial:
                indent = indent[:-2]
                lines.append(f"{indent}}}")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def pointers(self, stmts: list[Stmt]) -> list[str]:
        seen, lines = {}, []
        for buf in buffers_accessed(stmts):
            st = buf.storage
            if id(st) not in seen:
                seen[id(st)] = True
                const = "const " if st.kind in (WEIGHT, INPUT) else ""
                lines.append(f"  {const}{C_STORAGE[st.dtype]}* __restrict__ {self.buffer_name(st)} = "
                             f"({const}{C_STORAGE[st.dtype]}*){self.address[id(st)]};")
        return lines

    def header(self, name: str, kernel: Kernel, stmts: list[Stmt], threads: int) -> list[str]:
        params = ", ".join(f"unsigned char* __restrict__ p{i}" for i in range(len(self.params) - 2))
        params = (params + ", " if params else "") + "const unsigned char* __restrict__ weights, unsigned char* __restrict__ scratch"
        return [f'extern "C" __global__ void __launch_bounds__({threads}) {name}({params}) {{',
                f"  // {kernel.op_type} ({kernel.name})", *self.pointers(stmts)]

    def bind_threads(self, part: Unit, head: list[Loop], flat: str) -> list[str]:
        """A fused part's thread variables: the head's own where the extents agree, else split
        from the flat thread position (`fuse` checked the cells agree under that split)."""
        own = [loop for loop in part.nest.threads if loop.extent > 1]
        lines = []
        if [loop.extent for loop in own] == [loop.extent for loop in head]:
            for mine, first in zip(own, head):
                self._names[mine.var.uid] = self.var_name(first.var)
        else:
            lines += self.decompose(flat, own, "  ")
        for loop in part.nest.threads:
            if loop.extent == 1 and loop.var.uid not in self._names:
                lines.append(f"  const int {self.var_name(loop.var)} = 0;")
        return lines

    def decompose(self, flat: str, loops: list[Loop], indent: str) -> list[str]:
        """Declare each loop's variable from a flat index over the loops (the last varies fastest)."""
        lines = []
        for depth, loop in enumerate(reversed(loops)):
            inner = 1
            for other in loops[len(loops) - depth:]:
                inner *= other.extent
            value = f"(int)(({flat}) / {inner} % {loop.extent})" if inner > 1 else f"(int)(({flat}) % {loop.extent})"
            lines.append(f"{indent}const int {self.var_name(loop.var)} = {value};")
        return lines

    def tiled_function(self, unit: Unit, plan: TiledContraction) -> str:
        """A 16x16 output tile per block; K in steps of 16 through shared memory (see `tiled`).

        The maps fused after the contraction (`fuse`) run as its epilogue: each output's thread
        stores the finished sum, then applies them at its own cell, reading the sum from `acc`."""
        self._names = {}
        name, kernel, epilogue = unit.name, unit.kernel, unit.fused
        m, n, k = plan.extent(plan.rows), plan.extent(plan.cols), plan.extent(plan.k)
        y = self.buffer_name(plan.store.buffer.storage)
        lines = self.header(name, kernel, [plan.store, *(s for p in epilogue for s in p.stmts)], TILE * TILE)
        if epilogue:
            lines[1] = "  // fused: " + ", ".join(f"{p.kernel.op_type} ({p.kernel.name})" for p in unit.parts)
        lines += [f"  __shared__ float a_tile[{TILE}][{TILE + 1}];   // +1: no bank conflicts on column reads",
                  f"  __shared__ float b_tile[{TILE}][{TILE + 1}];",
                  "  const int tx = threadIdx.x, ty = threadIdx.y;",
                  f"  const int row = blockIdx.y * {TILE} + ty, col = blockIdx.x * {TILE} + tx;",
                  f"  const bool inside = row < {m} && col < {n};"]
        lines += self.decompose("blockIdx.z", plan.batch, "  ")
        lines += self.decompose("row", plan.rows, "  ")
        lines += self.decompose("col", plan.cols, "  ")
        index = self.expr(plan.store.index)
        lines += [f"  float acc = inside ? {y}[{index}] : 0.0f;",
                  f"  for (int k0 = 0; k0 < {k}; k0 += {TILE}) {{",
                  "    {", "      const int k_at = k0 + tx;", *self.decompose("k_at", plan.k, "      "),
                  f"      a_tile[ty][tx] = (row < {m} && k_at < {k}) ? (float)({self.expr(plan.a)}) : 0.0f;", "    }",
                  "    {", "      const int k_at = k0 + ty;", *self.decompose("k_at", plan.k, "      "),
                  f"      b_tile[ty][tx] = (col < {n} && k_at < {k}) ? (float)({self.expr(plan.b)}) : 0.0f;", "    }",
                  "    __syncthreads();",
                  f"    for (int kk = 0; kk < {TILE}; ++kk) acc = fmaf(a_tile[ty][kk], b_tile[kk][tx], acc);",
                  "    __syncthreads();",
                  "  }",
                  "  if (!inside) return;",
                  f"  {y}[{index}] = acc;"]
        lines += self.epilogue(unit, plan.store)
        lines.append("}")
        return "\n".join(lines) + "\n"

    def epilogue(self, unit: Unit, store: Store) -> list[str]:
        """The fused maps' bodies on the contraction's output coordinates (their thread loops in
        the same order over the same extents, which `fuse` checked)."""
        head = [loop for loop in unit.nest.threads if loop.extent > 1]
        flat = "0"
        for loop in head:
            flat = f"({flat} * {loop.extent} + {self.var_name(loop.var)})"
        lines = [f"  const long long cell = {flat};"]
        # `fuse` let in only reads of the group's tensors at the thread's own cell, and no second
        # store to them, so a float32 tensor stored once at the top of a body is its register there.
        stored: dict[int, int] = {}
        for part in unit.fused:
            for st in walk_stmts(part.nest.body):
                if isinstance(st, Store):
                    stored[id(st.buffer.storage)] = stored.get(id(st.buffer.storage), 0) + 1
        self._registers = {id(store.buffer.storage): "acc"}
        try:
            for part in unit.fused:
                lines += self.bind_threads(part, head, "cell")
                for st in part.nest.body:
                    target = st.buffer.storage if isinstance(st, Store) else None
                    if target is None or target.dtype != "float32" or stored[id(target)] != 1:
                        lines += self.stmt(st, "  ")
                        continue
                    register = f"r{len(self._registers)}"
                    lines.append(f"  const float {register} = (float)({self.expr(st.value)});")
                    lines.append(f"  {self.buffer_name(target)}[{self.expr(st.index)}] = {register};")
                    self._registers[id(target)] = register
        finally:
            self._registers = {}
        return lines

    def warp_row(self, body: list[Stmt], plans: dict[int, StridedLoop], indent: str) -> list[str]:
        """A row body on a warp: loops strided over the lanes, accumulators combined by shuffles."""
        lines = []
        for s in body:
            plan = plans.get(id(s))
            if plan is None:
                if isinstance(s, Assign):
                    lines += self.stmt(s, indent)          # every lane holds the same value
                else:
                    lines += [f"{indent}if (lane == 0) {{", *self.stmt(s, indent + "  "), f"{indent}}}",
                              f"{indent}__syncwarp();"]
                continue
            for loc, op in plan.accumulators:
                name, t = self.local_name(loc), C_COMPUTE[loc.type]
                lines += [f"{indent}const {t} {name}_before = {name};", f"{indent}{name} = {identity(op, loc.type)};"]
            var = self.var_name(plan.loop.var)
            lines.append(f"{indent}for (int {var} = lane; {var} < {plan.loop.extent}; {var} += 32) {{")
            lines += self.stmts(plan.loop.body, indent + "  ")
            lines.append(f"{indent}}}")
            for loc, op in plan.accumulators:
                name = self.local_name(loc)
                shuffled = f"__shfl_xor_sync(0xffffffffu, {name}, offset)"
                lines.append(f"{indent}for (int offset = 16; offset > 0; offset >>= 1) {name} = {combine(op, name, shuffled)};")
                lines.append(f"{indent}{name} = {combine(op, name + '_before', name)};")
            if plan.stores:
                lines.append(f"{indent}__syncwarp();   // the row's writes, visible to every lane")
        return lines

    # -- statements ----------------------------------------------------------------------------
    def stmts(self, stmts: list[Stmt], indent: str) -> list[str]:
        lines = []
        for s in stmts:
            lines += self.stmt(s, indent)
        return lines

    def stmt(self, s: Stmt, indent: str) -> list[str]:
        if isinstance(s, Store):
            st = s.buffer.storage
            value = self.expr(s.value)
            if st.dtype == "bool":
                value = f"({value}) != 0"
            if st.dtype in NARROW:
                return [f"{indent}{self.buffer_name(st)}[{self.expr(s.index)}] = {NARROW[st.dtype]}((float)({value}));"]
            return [f"{indent}{self.buffer_name(st)}[{self.expr(s.index)}] = ({C_STORAGE[st.dtype]})({value});"]
        if isinstance(s, Assign):
            return [f"{indent}{self.local_name(s.local)} = {self.expr(s.value)};"]
        if isinstance(s, If):
            lines = [f"{indent}if ({self.expr(s.cond)}) {{", *self.stmts(s.body, indent + "  ")]
            if s.orelse:
                lines += [f"{indent}}} else {{", *self.stmts(s.orelse, indent + "  ")]
            return lines + [f"{indent}}}"]
        if isinstance(s, Loop):
            if s.extent <= 0:
                return []
            var = self.var_name(s.var)
            return [f"{indent}for (int {var} = 0; {var} < {s.extent}; ++{var}) {{",
                    *self.stmts(s.body, indent + "  "), f"{indent}}}"]
        raise TypeError(f"unknown statement {s!r}")

    # -- expressions ---------------------------------------------------------------------------
    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            return number(e.value, e.type)
        if isinstance(e, Var):
            return self.var_name(e)
        if isinstance(e, Local):
            return self.local_name(e)
        if isinstance(e, Load):
            st = e.buffer.storage
            if id(st) in self._registers:
                return f"(({C_COMPUTE[e.type]}){self._registers[id(st)]})"   # this thread's own cell (see epilogue)
            element = f"{self.buffer_name(st)}[{self.expr(e.index)}]"
            return f"(({C_COMPUTE[e.type]}){WIDEN[st.dtype] + '(' + element + ')' if st.dtype in WIDEN else element})"
        if isinstance(e, Binary):
            return binary(e.op, e.a.type, self.expr(e.a), self.expr(e.b))
        if isinstance(e, Unary):
            return unary(e.op, e.a.type, e.type, self.expr(e.a))
        if isinstance(e, Select):
            return f"(({self.expr(e.cond)}) ? {self.expr(e.a)} : {self.expr(e.b)})"
        if isinstance(e, Cast):
            return cast(e.a.type, e.type, self.expr(e.a))
        if isinstance(e, Fma):
            fn = "fmaf" if e.type == "f32" else "fma"
            if e.type in FLOAT_TYPES:
                return f"{fn}({self.expr(e.a)}, {self.expr(e.b)}, {self.expr(e.c)})"
            return f"({self.expr(e.a)} * {self.expr(e.b)} + {self.expr(e.c)})"
        raise TypeError(f"unknown expression {e!r}")

    # -- names ---------------------------------------------------------------------------------
    def var_name(self, v: Var) -> str:
        if v.uid not in self._names:
            self._names[v.uid] = f"i{len(self._names)}"
        return self._names[v.uid]

    def local_name(self, loc: Local) -> str:
        if loc.uid not in self._names:
            self._names[loc.uid] = f"{re.sub(r'[^A-Za-z0-9]', '', loc.name) or 'l'}{len(self._names)}"
        return self._names[loc.uid]

    def buffer_name(self, storage) -> str:
        return f"b{self.program.storages.index(storage)}"


def _locals_in(stmts: list[Stmt]) -> set[int]:
    found = set()
    for s in walk_stmts(stmts):
        if isinstance(s, Assign):
            found.add(s.local.uid)
        for e in s.exprs():
            found |= {x.uid for x in walk(e) if isinstance(x, Local)}
    return found


def _locals_cross_statements(statements: list[Stmt]) -> bool:
    seen: set[int] = set()
    for s in statements:
        mine = _locals_in([s])
        if mine & seen:
            return True
        seen |= mine
    return False
