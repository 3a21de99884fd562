"""One CU's large contractions on several threads over one shared linear memory (`--features threads`).

A contraction big enough (`split_for`) is rendered as `kernel_parts` part functions that write
disjoint blocks of its output, each with scratch of its own, plus a serial prologue where the parts
share an operand packed at run time:
- a batched GEMM (attention's heads): batches, each part packing its own batches' B;
- a GEMM of one batch: blocks of 4-row tiles of A and C (B's panels read by every part), or for one
  row (a GEMV) blocks of 16-column panels of B and C; so is a one-row MatMulNBits product (a decode
  step's 4- or 8-bit weights), each part quantizing its copy of A;
- an implicit-GEMM Conv (`kernels/conv_implicit_gemm.py`): groups of output pixels, after the zero
  border (prologue), then the transpose into NCHW by blocks of output rows;
- an im2col Conv cut into chunks of output rows (large images): chunks, each part packing its own
  chunks' im2col (`kernels/conv.py`, `render_conv2d_chunk_parts`);
- any other im2col Conv with its weight packed at compile time: blocks of output channels, the
  weight packed part by part (`pack_conv_weight`) after one im2col in the prologue.
A loop-nest kernel whose outermost loop's iterations write disjoint cells (LayerNorm's or Softmax's
rows, a transpose's, a pooling's channels: `loop_split`) runs as parts of that loop's range. The
cut never splits a sum over K, and a part runs the same tile code on its rows as the whole
kernel would, so the result does not depend on which thread ran which part, or on how many threads
there were: a CU gives the same bits on 1, 2 or 3 threads (tests/test_kernel_threads.py).

At run time the CU's `run` reaches a split kernel's `$fork`: it publishes the job (its first part's
index in the module's function table and its part count) in a control block after the memory plan,
wakes the workers (`memory.atomic.notify`) and takes parts itself until none is left, then waits
until every part is done. A worker (`work`, one per extra thread, each its own instance of the same
module in a store of its own: `kernel_threads.py`) spins a little, then sleeps on the job's
generation, and takes parts as the caller does. A part is claimed by a compare-and-swap of one
64-bit word, (generation, next part), so a late worker can never claim a part of a later job; the
caller closes a finished job (next part = all ones) before it publishes the next one. With one
thread the caller simply runs every part itself.

A worker that traps sets `abort` (the host calls `fail` on its instance) and the caller, waiting,
traps too: the request fails in one line naming the CU and the worker, and the device gives the CU a
fresh memory and fresh workers, so the model goes on (`kernel_threads.py`, `device.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from backends.wasm.gemm import packed_b_size, render_gemm
from backends.wasm.kernels.conv import im2col_chunk_rows
from backends.wasm.kernels.conv_implicit_gemm import product_groups
from backends.wasm.kernels.block_quant import BlockQuantOffsets, block_bytes, render_block_quant_gemm
from backends.wasm.kernels.block_quant_panels import uses_gemm_tiles
from backends.wasm.kernels.gemv import gemv_fits, render_gemv
from backends.wasm.kernels.operands import GemmOffsets
from backends.wasm.kernels.pack_b import render_pack_b
from codegen.parallel_loops import threads_are_independent
from ir.loops.contraction import BlockQuantGemmSpec, ContractionSpec, ConvSpec, GemmSpec
from ir.loops.program import Assign, Kernel, Loop, Stmt, walk_stmts

# Words of the control block, byte offsets from its start (CONTROL_BYTES, after the memory plan).
WORD, GENERATION, BASE, COUNT, DONE, ABORT, STOP, ACTIVE, FAULT = 0, 4, 8, 12, 16, 20, 24, 28, 32
CONTROL_BYTES = 64
# A part is worth a thread's hand-off (a futex wake and the claim, 10-50 us on a busy 2-core
# machine) from this much work on: a contraction of less than twice it runs whole, and one of more
# runs as at most kernel_parts parts of at least it each. Measured: a 1x1 Conv of 6 MFLOP split 4
# ways ran 0.9x on 2 threads; 3x3 Convs of 60-460 MFLOP 1.6-1.7x.
MIN_PART_FLOPS = 2_500_000
# A float32 GEMV of one row reads 4 bytes of weights per 2 flops and is bound by memory, not by
# the FMA units: each weight byte counts as this many flops of work (2.5 MFLOP ~ 250 KB of weights,
# about 20 us at a core's copy bandwidth), so a decoder's or a classifier's sliced FC layers split too.
GEMV_FLOPS_PER_BYTE = 10
# Loads of the generation word a worker spins for before it sleeps (a few microseconds): the serial
# kernels between two forks are often shorter than a sleep and a wake.
SPIN = 20_000
# A loop-nest kernel's part runs at least this many innermost statements (about 40-100 us).
MIN_PART_ITERATIONS = 65_536
TILE = 4        # GEMM rows a tile holds: parts of rows are cut at whole tiles
PANEL = 16      # columns of a B panel: parts of columns are cut at whole panels
VECTOR_UNIT = 16    # elements: a vectorised loop is cut at multiples of 4 lanes x an unroll of 4


@dataclass(frozen=True)
class PartSplit:
    """How one contraction is cut: `axis` (batch, rows, columns, chunks, channels, groups, pixels) into `bounds`
    [(start, stop), ...], one per part, in the axis' units."""
    axis: str
    bounds: tuple[tuple[int, int], ...]
    depth: int = 0      # a loop-nest kernel's: how many loops of one trip enclose the loop cut

    @property
    def parts(self) -> int:
        return len(self.bounds)


def split_for(spec: ContractionSpec, conv_kernel, parts: int) -> PartSplit | None:
    """The cut of `spec` into `parts` parts, or None where it runs whole: too little work, or a
    kernel the parts do not cover (narrow and integer weights, depthwise Convs and Convs whose weight
    is not packed, transposed A). `conv_kernel`: the Conv kernel spec the backend chose (`conv_kernel_spec`)."""
    parts = min(parts, flops(spec, conv_kernel) // MIN_PART_FLOPS)    # fewer, larger parts for less work
    if parts < 2:
        return None
    if isinstance(spec, GemmSpec):
        if spec.b_format != "f32" or spec.trans_a:
            return None
        if spec.batch >= parts and not spec.constant_b:
            return PartSplit("batch", even(spec.batch, parts, 1))
        if spec.batch == 1 and spec.m >= 2 * TILE * parts:
            return PartSplit("rows", even(spec.m, parts, TILE))
        if spec.batch == 1 and spec.m == 1 and spec.constant_b and spec.n >= 2 * PANEL * parts:
            return PartSplit("columns", even(spec.n, parts, PANEL))
        return None
    if isinstance(spec, BlockQuantGemmSpec):    # a decode step's 4- or 8-bit GEMV: panels of columns
        if spec.m == 1 and not uses_gemm_tiles(spec) and spec.n >= 2 * PANEL * parts:
            return PartSplit("columns", even(spec.n, parts, PANEL))
        return None
    if isinstance(spec, ConvSpec) and conv_kernel.implicit_gemm:
        groups = product_groups(conv_kernel, parts)
        return PartSplit("pixels", even(groups, parts, 1)) if groups >= 2 else None
    if isinstance(spec, ConvSpec):
        from_chunks = conv_chunks(conv_kernel)
        if from_chunks is not None and from_chunks >= parts:
            return PartSplit("chunks", even(from_chunks, parts, 1))
        if from_chunks is None and conv_kernel.packed_a and conv_kernel.groups == 1 \
                and conv_kernel.out_channels >= 2 * TILE * parts:
            return PartSplit("channels", even(conv_kernel.out_channels, parts, TILE))
        # A grouped Conv's groups are independent products over one im2col: whole groups a part.
        if from_chunks is None and conv_kernel.packed_a and conv_kernel.groups >= 2:
            count = min(parts, conv_kernel.groups)
            return PartSplit("groups", even(conv_kernel.groups, count, 1))
    return None


def flops(spec: ContractionSpec, conv_kernel) -> int:
    """The contraction's work in flops (a float32 GEMV's: its weight bytes' worth)."""
    if isinstance(spec, GemmSpec):
        if spec.m == 1 and spec.batch == 1 and spec.constant_b and spec.b_format == "f32":
            return max(2 * spec.n * spec.k, GEMV_FLOPS_PER_BYTE * 4 * spec.n * spec.k)
        return 2 * spec.m * spec.n * spec.k * spec.batch
    if isinstance(spec, BlockQuantGemmSpec):
        return 2 * spec.m * spec.n * spec.k
    if isinstance(spec, ConvSpec):
        return 2 * conv_kernel.out_channels * conv_kernel.pixels * conv_kernel.gemm_k * spec.batch
    return 0


def loop_split(kernel: Kernel, parts: int, vectorized) -> PartSplit | None:
    """The cut of a loop-nest kernel (LayerNorm's rows, a Softmax's, a pooling's channels, a
    transpose's rows...) along its outermost loop of more than one trip, or None: where the kernel
    is one loop nest whose that loop writes disjoint cells from iteration to iteration and reads back only its own
    (`codegen/parallel_loops.py`, the test CUDA's threads pass), runs at least `2 * parts` times and
    does at least `MIN_PART_ITERATIONS` iterations a part. `vectorized(loop)`: whether the renderer
    vectorises that loop itself (a one-loop elementwise kernel)."""
    if parts < 2 or len(kernel.body) != 1 or not isinstance(kernel.body[0], Loop):
        return None
    chain = [kernel.body[0]]
    while len(chain[-1].body) == 1 and isinstance(chain[-1].body[0], Loop):
        chain.append(chain[-1].body[0])
    depth = next((d for d, loop in enumerate(chain) if loop.extent > 1), None)   # past a batch of one
    if depth is None:
        return None
    outer = chain[depth]
    # A loop the renderer vectorises itself (an elementwise kernel's one loop) is cut at multiples of
    # 16 lanes, so each element takes the vector or the scalar path it takes whole; not one that
    # folds a reduction's lanes after it.
    vector = vectorized(outer)
    if vector and any(isinstance(s, Assign) for s in walk_stmts(outer.body)):
        return None
    unit = VECTOR_UNIT if vector else 1
    parts = min(parts, iterations(kernel.body) // MIN_PART_ITERATIONS, outer.extent // (2 * unit))
    if parts < 2:
        return None
    if not threads_are_independent([outer], chain, chain[-1].body):
        return None
    return PartSplit("loop", even(outer.extent, parts, unit), depth)


def iterations(stmts: list[Stmt]) -> int:
    """Innermost statements executed: each loop's extent times its body's."""
    total = 0
    for s in stmts:
        if isinstance(s, Loop):
            total += s.extent * max(1, iterations(s.body))
        else:
            total += 1
    return total


def conv_chunks(conv_kernel) -> int | None:
    """The number of row chunks an im2col Conv runs in (whole ones and a shorter last one), or None."""
    if conv_kernel.implicit_gemm or conv_kernel.groups != 1:
        return None
    rows = im2col_chunk_rows(conv_kernel)
    return None if rows is None else -(-conv_kernel.out_height // rows)


def render_gemm_parts(spec: GemmSpec, at: GemmOffsets, b_source: int | None, blocks_bytes: int, split: PartSplit,
                      features, name: str) -> tuple[str, list[tuple[str | None, list[str]]]]:
    """A GEMM as parts: functions, and its one step (the serial packing of an activation B that
    every part reads, or None, then the parts' names). `at.b_packed` is B's panels (the scratch
    `b_source` is packed into, for an activation B); each part has `blocks_bytes` of A's scratch
    of its own after `at.a_scratch`."""
    m, n, k = spec.m, spec.n, spec.k
    funcs, names, prologue = [], [], None
    gemv = gemv_fits(spec, features)
    if b_source is not None and split.axis != "batch":
        prologue = f"{name}_pack"
        funcs.append(render_pack_b(k, n, src_offset=b_source, dst_offset=at.b_packed, trans_b=spec.trans_b,
                                   batch=spec.batch, name=prologue, features=features & {"simd"}))
    for p, (start, stop) in enumerate(split.bounds):
        part = f"{name}_part{p}"
        scratch = None if at.a_scratch is None else at.a_scratch + p * blocks_bytes
        if split.axis == "batch":
            c = start * m * n * 4
            offsets = GemmOffsets(at.a + start * m * k * 4, at.b_packed + start * packed_b_size(k, n), at.c + c,
                                  bias=at.bias, residual=None if at.residual is None else at.residual + c,
                                  a_scratch=scratch)
            body = [render_gemm(replace(spec, batch=stop - start), offsets, features=features, name=f"{part}_gemm")]
            if b_source is not None:    # each part packs its own batches' B
                body.insert(0, render_pack_b(k, n, src_offset=b_source + start * k * n * 4,
                                             dst_offset=offsets.b_packed, trans_b=spec.trans_b, batch=stop - start,
                                             name=f"{part}_pack", features=features & {"simd"}))
                body.append(f"(func ${part}\n  (call ${part}_pack)\n  (call ${part}_gemm)\n)\n")
            else:
                body.append(f"(func ${part}\n  (call ${part}_gemm)\n)\n")
            funcs += body
        elif split.axis == "rows":
            c = start * n * 4
            offsets = GemmOffsets(at.a + start * k * 4, at.b_packed, at.c + c, bias=at.bias,
                                  residual=None if at.residual is None else at.residual + c, a_scratch=scratch)
            funcs.append(render_gemm(replace(spec, m=stop - start), offsets, features=features, name=part))
        else:   # columns of a GEMV: whole panels of B
            shift = start * 4
            offsets = GemmOffsets(at.a, at.b_packed + start // PANEL * k * PANEL * 4, at.c + shift,
                                  bias=None if at.bias is None else at.bias + shift,
                                  residual=None if at.residual is None else at.residual + shift, a_scratch=scratch)
            part_spec = replace(spec, n=stop - start)
            render = render_gemv if gemv else render_gemm
            funcs.append(render(part_spec, offsets, features=features, name=part))
        names.append(part)
    return "".join(funcs), [(prologue, names)]


def render_block_quant_parts(spec: BlockQuantGemmSpec, at: BlockQuantOffsets, scratch_bytes: int, split: PartSplit,
                             features, name: str) -> tuple[str, list[tuple[str | None, list[str]]]]:
    """A one-row MatMulNBits product as parts of whole 16-column panels of B (one run of bytes
    each: `blocks` blocks of `block_bytes`), each part quantizing or copying A into scratch of its
    own (`scratch_bytes` after `at.scratch`), then its columns."""
    panel_bytes = -(-spec.k // spec.block) * block_bytes(spec)
    funcs, names = [], []
    for p, (start, stop) in enumerate(split.bounds):
        offsets = BlockQuantOffsets(at.a, at.b + start // PANEL * panel_bytes, at.c + start * 4,
                                    at.scratch + p * scratch_bytes, None if at.bias is None else at.bias + start * 4)
        names.append(f"{name}_part{p}")
        funcs.append(render_block_quant_gemm(replace(spec, n=stop - start), offsets, features=features, name=names[-1]))
    return "".join(funcs), [(None, names)]


def render_split_call(name: str, steps: list[tuple[str | None, list[str]]], table: list[str]) -> str:
    """`$name`: each step's serial function, then a fork over its parts, whose names join the
    module's function `table` (a part is called by its index there)."""
    lines = []
    for prologue, parts in steps:
        if prologue is not None:
            lines.append(f"  (call ${prologue})")
        lines.append(f"  (call $fork (i32.const {len(table)}) (i32.const {len(parts)}))")
        table.extend(parts)
    return f"(func ${name}\n" + "\n".join(lines) + "\n)\n"


def even(total: int, parts: int, unit: int) -> tuple[tuple[int, int], ...]:
    """`total` cut into `parts` ranges of whole `unit`s (the last takes the remainder), as even as
    the units allow; none empty."""
    units = -(-total // unit)
    parts = min(parts, units)
    cuts = [unit * (units * p // parts) for p in range(parts + 1)]
    cuts[-1] = total
    return tuple((cuts[p], cuts[p + 1]) for p in range(parts))


def threads_control(memory_bytes: int) -> int:
    """Where a module's control block starts: after its memory plan, on a cache line of its own."""
    return -(-memory_bytes // CONTROL_BYTES) * CONTROL_BYTES


def render_runtime(control: int) -> str:
    """The functions every module with split kernels holds: `$fork` (the caller's side of a job),
    `$take` (claim and run parts), the exports `work` (a worker's loop), `fail` and `stop`."""
    at = {name: control + off for name, off in
          (("word", WORD), ("gen", GENERATION), ("base", BASE), ("count", COUNT), ("done", DONE), ("abort", ABORT),
           ("stop", STOP), ("active", ACTIVE), ("fault", FAULT))}
    return f"""  (type $part (func))
  (func $fork (param $base i32) (param $count i32) (local $g i32) (local $d i32)
    (i32.atomic.store (i32.const {at['base']}) (local.get $base))
    (i32.atomic.store (i32.const {at['count']}) (local.get $count))
    (i32.atomic.store (i32.const {at['done']}) (i32.const 0))
    (local.set $g (i32.add (i32.atomic.load (i32.const {at['gen']})) (i32.const 1)))
    (i64.atomic.store (i32.const {at['word']}) (i64.shl (i64.extend_i32_u (local.get $g)) (i64.const 32)))
    (drop (memory.atomic.notify (i32.const {at['gen']}) (i32.const -1)))
    (call $take (local.get $g) (i32.const 0))
    (loop $wait
      (if (i32.atomic.load (i32.const {at['abort']})) (then (unreachable)))
      (local.set $d (i32.atomic.load (i32.const {at['done']})))
      (if (i32.lt_u (local.get $d) (local.get $count)) (then
        (drop (memory.atomic.wait32 (i32.const {at['done']}) (local.get $d) (i64.const 1000000)))
        (br $wait))))
    ;; closed: a worker still holding this generation's word fails its compare-and-swap
    (i64.atomic.store (i32.const {at['word']})
      (i64.or (i64.shl (i64.extend_i32_u (local.get $g)) (i64.const 32)) (i64.const 0xffffffff))))
  (func $take (param $g i32) (param $tid i32) (local $w i64) (local $p i32)
    (loop $next
      (local.set $w (i64.atomic.load (i32.const {at['word']})))
      (if (i32.ne (i32.wrap_i64 (i64.shr_u (local.get $w) (i64.const 32))) (local.get $g)) (then (return)))
      (local.set $p (i32.wrap_i64 (local.get $w)))
      (if (i32.ge_u (local.get $p) (i32.atomic.load (i32.const {at['count']}))) (then (return)))
      (br_if $next (i64.ne (i64.atomic.rmw.cmpxchg (i32.const {at['word']}) (local.get $w)
                                                   (i64.add (local.get $w) (i64.const 1))) (local.get $w)))
      (drop (i32.atomic.rmw.add (i32.const {at['active']}) (i32.const 1)))
      (call_indirect (type $part) (i32.add (i32.atomic.load (i32.const {at['base']})) (local.get $p)))
      ;; a fault injected by the host (tests): a worker traps after its part, the job half done
      (if (i32.and (i32.ne (local.get $tid) (i32.const 0)) (i32.atomic.load (i32.const {at['fault']})))
        (then (unreachable)))
      (drop (i32.atomic.rmw.add (i32.const {at['done']}) (i32.const 1)))
      (drop (i32.atomic.rmw.sub (i32.const {at['active']}) (i32.const 1)))
      (drop (memory.atomic.notify (i32.const {at['done']}) (i32.const 1)))
      (br $next)))
  (func (export "work") (param $tid i32) (local $seen i32) (local $g i32) (local $spin i32)
    (local.set $seen (i32.atomic.load (i32.const {at['gen']})))
    (loop $forever
      (if (i32.atomic.load (i32.const {at['stop']})) (then (return)))
      (local.set $g (i32.atomic.load (i32.const {at['gen']})))
      (if (i32.ne (local.get $g) (local.get $seen)) (then
        (local.set $seen (local.get $g))
        (call $take (local.get $g) (local.get $tid))
        (local.set $spin (i32.const 0))
        (br $forever)))
      (if (i32.lt_u (local.get $spin) (i32.const {SPIN})) (then
        (local.set $spin (i32.add (local.get $spin) (i32.const 1)))
        (br $forever)))
      (drop (memory.atomic.wait32 (i32.const {at['gen']}) (local.get $seen) (i64.const 100000000)))
      (br $forever)))
  (func (export "fail")
    (i32.atomic.store (i32.const {at['abort']}) (i32.const 1))
    (drop (memory.atomic.notify (i32.const {at['done']}) (i32.const -1))))
  (func (export "stop")
    (i32.atomic.store (i32.const {at['stop']}) (i32.const 1))
    (drop (memory.atomic.notify (i32.const {at['gen']}) (i32.const -1))))
"""
