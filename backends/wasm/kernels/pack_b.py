"""B packed at run time: a row-major B (an activation: attention's Q @ K^T, scores @ V, or an
im2col) copied from memory into the 16-column panel layout of `backends/wasm/gemm.py`'s `pack_b`.

- `render_pack_b(k, n, *, src_offset, dst_offset, trans_b=False, batch=1, name="pack_b",
  features=SIMD) -> str`: a function that packs B (K x N row-major, or N x K with trans_b) at
  `src_offset` into panels at `dst_offset` (`packed_b_size(k, n)` bytes per batch).
"""

from __future__ import annotations

from backends.wasm.gemm import SIMD, _check_features, packed_b_size
from backends.wasm.kernels.microkernel import PANEL, PANEL_BYTES
from backends.wasm.kernels.wat_loops import counted_range, wat_function


def render_pack_b(k: int, n: int, *, src_offset: int, dst_offset: int, trans_b: bool = False,
                  batch: int = 1, name: str = "pack_b", features=SIMD) -> str:
    """Pack B (K x N row-major, or N x K with trans_b) from memory into panels, at run time, for
    products whose B is an activation (attention's Q @ K^T, scores @ V); `batch` dense matrices."""
    features = _check_features(features)
    src_stride, dst_stride = k * n * 4, packed_b_size(k, n)
    panels = -(-n // PANEL)
    # dst[p][kk][l] = B[kk, 16p + l] or 0 past N; B[kk, c] is at src + (kk*n + c)*4, or (c*k + kk)*4 transposed
    if "simd" in features and not trans_b:
        body = _vector_panels(k, n)
    else:
        src_col = (f"(i32.add (i32.mul (local.get $i) (i32.const {n})) (local.get $n))" if not trans_b
                   else f"(i32.add (i32.mul (local.get $n) (i32.const {k})) (local.get $i))")
        lane = [
            "(local.set $n (i32.add (i32.mul (local.get $j) (i32.const 16)) (local.get $pc)))",
            f"(local.set $pb (i32.add (local.get $B) (i32.shl (i32.add (i32.mul (i32.add (i32.mul (local.get $j) (i32.const {k})) (local.get $i)) (i32.const {PANEL})) (local.get $pc)) (i32.const 2))))",
            f"(f32.store (local.get $pb) (select (f32.load (i32.add (local.get $A) (i32.shl {src_col} (i32.const 2)))) "
            f"(f32.const 0) (i32.lt_u (local.get $n) (i32.const {n}))))",
        ]
        # $pc counts the lane here; out-of-range lanes load a clamped (valid) address and store 0
        lane[2] = lane[2].replace(src_col, f"(select {src_col} (i32.const 0) (i32.lt_u (local.get $n) (i32.const {n})))")
        body = counted_range("$j", 0, panels, 1, counted_range("$i", 0, k, 1, counted_range("$pc", 0, PANEL, 1, lane)))
    code = [f"(local.set $A (i32.const {src_offset}))", f"(local.set $B (i32.const {dst_offset}))"]
    if batch == 1:
        code += body
    else:
        code += ["(local.set $first (i32.const 0))", "(loop $batch", *("  " + s for s in body),
                 f"  (local.set $A (i32.add (local.get $A) (i32.const {src_stride})))",
                 f"  (local.set $B (i32.add (local.get $B) (i32.const {dst_stride})))",
                 "  (local.set $first (i32.add (local.get $first) (i32.const 1)))",
                 f"  (br_if $batch (i32.lt_u (local.get $first) (i32.const {batch}))))"]
    decls = ["(local $A i32) (local $B i32) (local $i i32) (local $j i32) (local $n i32) (local $first i32)",
             "(local $pa i32) (local $pb i32) (local $pc i32)"]
    title = f";; pack B[{k}x{n}]{' (given transposed)' if trans_b else ''} into 16-column panels{f' x {batch} batches' if batch > 1 else ''}"
    return wat_function(name, title, decls, code)


def _vector_panels(k: int, n: int) -> list[str]:
    """B panel by panel, each written front to back (measured faster than reading B row by row and
    scattering its 64-byte pieces over the panels: 1x1 Conv 256->128 at 56x56 4.68 vs 4.93 ms): a whole
    panel's row is 4 v128 copies; the edge panel's row its `n % 16` floats, their 4-float groups as
    v128, the rest lane by lane (never reading past the row), then zeros."""
    full, edge = divmod(n, PANEL)
    code = []
    if full:
        code += counted_range("$j", 0, full, 1, [
            f"(local.set $pa (i32.add (local.get $A) (i32.shl (local.get $j) (i32.const 6))))",
            f"(local.set $pb (i32.add (local.get $B) (i32.mul (local.get $j) (i32.const {k * PANEL_BYTES}))))",
            f"(local.set $pc (i32.add (local.get $pb) (i32.const {k * PANEL_BYTES})))",
            "(loop $rows",
            *(f"  (v128.store offset={16 * v} (local.get $pb) (v128.load offset={16 * v} (local.get $pa)))" for v in range(4)),
            f"  (local.set $pa (i32.add (local.get $pa) (i32.const {n * 4})))",
            f"  (local.set $pb (i32.add (local.get $pb) (i32.const {PANEL_BYTES})))",
            "  (br_if $rows (i32.lt_u (local.get $pb) (local.get $pc))))"])
    if edge:
        row = []
        for v in range(PANEL // 4):
            lanes = min(4, max(0, edge - 4 * v))
            value = f"(v128.load offset={16 * v} (local.get $pa))" if lanes == 4 else "(v128.const i32x4 0 0 0 0)"
            for lane in range(lanes if lanes < 4 else 0):
                value = f"(f32x4.replace_lane {lane} {value} (f32.load offset={16 * v + 4 * lane} (local.get $pa)))"
            row.append(f"(v128.store offset={16 * v} (local.get $pb) {value})")
        code += [
            f"(local.set $pa (i32.add (local.get $A) (i32.const {full * PANEL_BYTES})))",
            f"(local.set $pb (i32.add (local.get $B) (i32.const {full * k * PANEL_BYTES})))",
            f"(local.set $pc (i32.add (local.get $pb) (i32.const {k * PANEL_BYTES})))",
            "(loop $edge_rows", *("  " + r for r in row),
            f"  (local.set $pa (i32.add (local.get $pa) (i32.const {n * 4})))",
            f"  (local.set $pb (i32.add (local.get $pb) (i32.const {PANEL_BYTES})))",
            "  (br_if $edge_rows (i32.lt_u (local.get $pb) (local.get $pc))))"]
    return code
