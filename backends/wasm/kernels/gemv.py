"""The SIMD128 kernel for GEMMs of one or two rows (GEMV: a recurrent layer's step, a classifier's
last layer at batch 1), over B packed in the GEMM's 16-column panels (`gemm.pack_b`).

The GEMM's register tile (kernels/microkernel.py) is built for 4-row tiles; with one or two rows it
runs at 31-34 GFLOP/s. Here each panel is one pass over K with 8 accumulators: two rows x 4 vectors,
or one row x 4 vectors x 2 sets (even and odd k steps, added at the end, so that 8 multiply-add
chains cover the latency), 4 k steps per iteration with a test of `$pb` against `$pend` between
steps (which keeps each step's loads next to its multiply-adds, see microkernel.py). A is broadcast
with `v128.load32_splat`. The multiply-add names the B vector first: Cranelift's FMA overwrites its
first multiplicand, and with B first (one use per row) no splat is copied per multiply-add.
Measured (wasmtime 50, relaxed SIMD, CPU time, median of 5 interleaved rounds, GFLOP/s, GEMM tile ->
this kernel): 1x384x128 35.1 -> 55.7, 1x1536x512 30.7 -> 44.6, 2x1536x512 30.7 -> 51.7,
2x768x768 30.0 -> 51.6, 2x512x128 33.2 -> 53.3; with mul + add (SIMD without relaxed) 41-50.
B is read once per product whatever the row count, so above two rows the GEMM's tiles stay.

A narrow B (kernels/narrow_panels.py) is widened in registers as each k step is loaded: bf16 by one
byte shuffle a vector, fp16 by that shuffle, three integer ops and a multiply, int8 by extends and a
conversion (each column's sum scaled once). Measured (1x4096x4096, wasmtime, relaxed SIMD, best of
10-15 calls, 2 shared cores under other load): an fp16 variant's MatMul ran Cast + float32 GEMV in
61.5 ms, reading fp16 7.6 ms; the fp16 GEMV alone 4.5-7.2 ms (bf16 1.4-3.5, float32 3.2-5.1). On
that Intel CPU a multiply whose input lanes hold a float32 subnormal (what an fp16 subnormal weight
becomes before the x 2^112; 0.3% of N(0, 1/K) weights) takes a microcode assist: with B in cache,
2.4 ms without such weights, 4.4 with them. An exact widening that never forms a subnormal (the
smaller of two candidates by integer rebias, `f32x4.pmin`) measured 14 ms, so the multiply stays.
"""

from __future__ import annotations

from backends.wasm.kernels.activation import scratch_locals, v128_activation
from backends.wasm.kernels.narrow_panels import narrow_panel_bytes, widened_16_bits
from backends.wasm.kernels.operands import GemmOffsets
from ir.loops.contraction import GemmSpec

PANEL = 16
MAX_ROWS = 2
STEPS = 4          # k steps per loop iteration
ZERO = "(v128.const f32x4 0 0 0 0)"


def gemv_fits(spec: GemmSpec, features) -> bool:
    """Whether this kernel runs `spec`: SIMD, at most two rows, one batch."""
    return "simd" in frozenset(features) and spec.m <= MAX_ROWS and spec.batch == 1


def render_gemv(spec: GemmSpec, at: GemmOffsets, *, features, name: str = "gemv") -> str:
    """`(func $name)`: C[m x n] = activation(A @ B + bias + residual) at the byte offsets `at` (B as
    panels at `at.b_packed`; A row-major, or [k, m] with `spec.trans_a`). The residual may be C."""
    m, n, k = spec.m, spec.n, spec.k
    fma = "relaxed-simd" in frozenset(features)
    step_bytes = narrow_panel_bytes(spec.b_format)
    scales_at = at.b_packed + -(-n // PANEL) * k * step_bytes     # int8: the column scales follow the panels
    a_k_step, a_row_step = (m * 4, 4) if spec.trans_a else (4, k * 4)
    sets = 2 if m == 1 else 1
    accs = [[[f"$c{r}_{s}_{v}" for v in range(4)] for s in range(sets)] for r in range(m)]

    def madd(b: str, a: str, c: str) -> str:
        if fma:
            return f"(f32x4.relaxed_madd {b} {a} {c})"
        return f"(f32x4.add (f32x4.mul {b} {a}) {c})"

    body: list[str] = []
    for step in range(STEPS):
        s = step % sets
        body += [f"(local.set $a{r} (v128.load32_splat offset={r * a_row_step} (local.get $pa)))" for r in range(m)]
        body += _load_b(spec.b_format)
        body += [f"(local.set {accs[r][s][v]} {madd(f'(local.get $b{v})', f'(local.get $a{r})', f'(local.get {accs[r][s][v]})')})"
                 for r in range(m) for v in range(4)]
        body += [f"(local.set $pa (i32.add (local.get $pa) (i32.const {a_k_step})))",
                 f"(local.set $pb (i32.add (local.get $pb) (i32.const {step_bytes})))"]
        if step < STEPS - 1:
            body.append("(br_if $kdone (i32.ge_u (local.get $pb) (local.get $pend)))")
    k_loop = ["(block $kdone (loop $k", *("  " + line for line in body),
              "  (br_if $k (i32.lt_u (local.get $pb) (local.get $pend)))))"]

    def panel(lanes: list[int]) -> list[str]:
        """One panel at $j (its first column 16 $j), `lanes` real columns per vector."""
        code = [f"(local.set $pa (i32.const {at.a}))",
                f"(local.set $pb (i32.add (i32.const {at.b_packed}) (i32.mul (local.get $j) (i32.const {k * step_bytes}))))",
                f"(local.set $pend (i32.add (local.get $pb) (i32.const {k * step_bytes})))",
                *(f"(local.set {x} {ZERO})" for r in range(m) for s in range(sets) for x in accs[r][s]),
                *k_loop]
        for r in range(m):
            for v, width in enumerate(lanes):
                total = f"(local.get {accs[r][0][v]})"
                for s in range(1, sets):
                    total = f"(f32x4.add {total} (local.get {accs[r][s][v]}))"
                column = f"(i32.add (i32.shl (local.get $j) (i32.const 6)) (i32.const {16 * v}))"
                if spec.b_format == "int8":     # the same products, each column's sum scaled once
                    total = f"(f32x4.mul {total} (v128.load offset={scales_at} {column}))"
                if at.bias is not None:
                    total = f"(f32x4.add {total} {load_lanes(at.bias, column, width)})"
                row_at = f"(i32.add {column} (i32.const {r * n * 4}))"
                if at.residual is not None:
                    total = f"(f32x4.add {total} {load_lanes(at.residual, row_at, width)})"
                code.append(f"(local.set {accs[r][0][v]} {total})")
                code += v128_activation(spec.epilogue.activation, accs[r][0][v])
                code += store_lanes(at.c, row_at, width, accs[r][0][v])
        return code

    full, edge = divmod(n, PANEL)
    code = []
    if full:
        code += ["(local.set $j (i32.const 0))", "(loop $panel", *("  " + line for line in panel([4] * 4)),
                 "  (local.set $j (i32.add (local.get $j) (i32.const 1)))",
                 f"  (br_if $panel (i32.lt_u (local.get $j) (i32.const {full}))))"]
    if edge:    # the packed panel is zero-padded: compute all 16 columns, store the real ones
        code += [f"(local.set $j (i32.const {full}))",
                 *panel([max(0, min(4, edge - 4 * v)) for v in range(4)])]
    decls = [" ".join(f"(local {x} v128)" for r in range(m) for s in range(sets) for x in accs[r][s]),
             " ".join(f"(local $a{r} v128)" for r in range(m)) + " " + " ".join(f"(local $b{v} v128)" for v in range(4))
             + " (local $w0 v128) (local $w1 v128)",
             "(local $pa i32) (local $pb i32) (local $pend i32) (local $j i32)", *scratch_locals("v128")]
    title = (f";; C[{m}x{n}] = {spec.epilogue.activation or 'identity'}(A{'^T' if spec.trans_a else ''}[{m}x{k}] @ "
             f"B[{k}x{n}]{'' if spec.b_format == 'f32' else ' (' + spec.b_format + ')'}{' + bias' if at.bias is not None else ''}{' + residual' if at.residual is not None else ''})"
             f" as a GEMV; features: {','.join(sorted(features))}")
    return "\n".join([f"(func ${name}", "  " + title, *("  " + d for d in decls), *("  " + c for c in code), ")"]) + "\n"



def _load_b(format: str) -> list[str]:
    """$b0 .. $b3: the 16 columns of B at one k, at $pb, as float32 (int8: the codes, unscaled)."""
    if format == "f32":
        return [f"(local.set $b{v} (v128.load offset={16 * v} (local.get $pb)))" for v in range(4)]
    if format in ("bf16", "fp16"):
        return ["(local.set $w0 (v128.load (local.get $pb)))", "(local.set $w1 (v128.load offset=16 (local.get $pb)))",
                *(f"(local.set $b{v} {vector})"
                  for v, vector in enumerate(widened_16_bits(format, "(local.get $w0)", "(local.get $w1)")))]
    if format == "int8":
        return ["(local.set $w0 (v128.load (local.get $pb)))",
                "(local.set $w1 (i16x8.extend_high_i8x16_s (local.get $w0)))",
                "(local.set $w0 (i16x8.extend_low_i8x16_s (local.get $w0)))",
                *(f"(local.set $b{2 * w + h} (f32x4.convert_i32x4_s (i32x4.extend_{half}_i16x8_s (local.get $w{w}))))"
                  for w in range(2) for h, half in enumerate(("low", "high")))]
    raise ValueError(f"unknown B format {format!r}")


def load_lanes(base: int, offset: str, lanes: int) -> str:
    """`lanes` float32s at `base` + `offset` (an i32 expression) as a v128, the rest 0."""
    if lanes == 4:
        return f"(v128.load offset={base} {offset})"
    value = ZERO
    for lane in range(lanes):     # never read past the last real column
        value = f"(f32x4.replace_lane {lane} {value} (f32.load offset={base + 4 * lane} {offset}))"
    return value


def store_lanes(base: int, offset: str, lanes: int, reg: str) -> list[str]:
    """Store the first `lanes` float32s of local `reg` at `base` + `offset`."""
    if lanes == 4:
        return [f"(v128.store offset={base} {offset} (local.get {reg}))"]
    return [f"(f32.store offset={base + 4 * lane} {offset} (f32x4.extract_lane {lane} (local.get {reg})))"
            for lane in range(lanes)]
