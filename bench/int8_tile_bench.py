"""The integer GEMM's register tile alone (kernels/int8_gemm.py `render_k_function`): GMAC/s of one
tile's k loop over a panel that stays in L1, under wasmtime, interleaved. What chose the 16-bit
kernel's tile and A layout:

- `4x8 shuffled A`: one v128 of 4 rows per k pair, each row's pair broadcast by a shuffle (the
  layout the integer Conv's weight and the relaxed kernel keep);
- `4x8 broadcast A`: each row's pair packed already broadcast (kernels/int8_pack_a.py), a plain load;
- wider tiles, R rows x C columns with broadcast A (more accumulators per loaded B vector), which
  Cranelift's 16 XMM registers do not hold.

`python -m bench.int8_tile_bench [--rounds N] [--k K]` prints one line per tile."""

from __future__ import annotations

import argparse

from backends.wasm.kernels.int8_gemm import render_k_function
from backends.wasm.kernels.standalone import instantiate
from bench.timing import InProcess, interleave

TILE_AT = 64   # the 128-byte tile the k function leaves its sums in (wider tiles: up to 384 bytes)
A_AT = 1024


def render_wide_tile(name: str, rows: int, vectors: int) -> str:
    """A k function like `render_k_function(..., broadcast_a=True)` for `rows` x 4 * `vectors`
    columns (B panels of 4 * `vectors` columns), unrolled by 4."""
    accs = [f"$c{r}_{v}" for r in range(rows) for v in range(vectors)]
    decls = " ".join(f"(local {a} v128)" for a in accs) + " (local $a v128) " + " ".join(
        f"(local $b{v} v128)" for v in range(vectors))

    def step() -> list[str]:
        code = [f"(local.set $b{v} (v128.load offset={16 * v} (local.get $pb)))" for v in range(vectors)]
        for r in range(rows):
            code.append(f"(local.set $a (v128.load offset={16 * r} (local.get $pa)))")
            code += [f"(local.set $c{r}_{v} (i32x4.add (local.get $c{r}_{v}) (i32x4.dot_i16x8_s (local.get $a) "
                     f"(local.get $b{v}))))" for v in range(vectors)]
        return code + [f"(local.set $pa (i32.add (local.get $pa) (i32.const {16 * rows})))",
                       f"(local.set $pb (i32.add (local.get $pb) (i32.const {16 * vectors})))"]

    body = []
    for u in range(4):
        body += step() + ["(br_if $done (i32.ge_u (local.get $pb) (local.get $pend)))" if u < 3
                          else "(br_if $k (i32.lt_u (local.get $pb) (local.get $pend)))"]
    init = [f"(local.set {a} (v128.const i32x4 0 0 0 0))" for a in accs]
    stores = [f"(v128.store offset={TILE_AT + 16 * i} (i32.const 0) (local.get {a}))" for i, a in enumerate(accs)]
    return "\n".join([f"(func ${name} (param $pa i32) (param $pb i32) (param $pend i32) {decls}", *init,
                      "(block $done (loop $k", *body, "))", *stores, ")"]) + "\n"


def tile_contestant(label: str, k_function: str, rows: int, columns: int, a_pair_bytes: int, k: int, calls: int):
    pairs = -(-k // 2)
    b_at = A_AT + pairs * a_pair_bytes + 64
    b_end = b_at + pairs * columns * 4
    repeat = f"""(func $repeat (param $n i32)
  (loop $again
    (call $tile (i32.const {A_AT}) (i32.const {b_at}) (i32.const {b_end}))
    (local.set $n (i32.sub (local.get $n) (i32.const 1)))
    (br_if $again (local.get $n))))
"""
    store, instance = instantiate(k_function + repeat, b_end + 64, {"simd"})
    run = instance.exports(store)["repeat"]
    return InProcess(label, lambda: run(store, calls)), calls * k * rows * columns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--k", type=int, default=384)
    args = parser.parse_args()
    calls = max(1, int(20e6 // (args.k * 32)))
    tiles = [("4x8 shuffled A", render_k_function("tile", 4, TILE_AT, False), 4, 8, 16),
             ("4x8 broadcast A", render_k_function("tile", 4, TILE_AT, False, broadcast_a=True), 4, 8, 64)]
    tiles += [(f"{r}x{4 * v} broadcast A", render_wide_tile("tile", r, v), r, 4 * v, 16 * r)
              for r, v in ((5, 2), (6, 2), (4, 3), (3, 4))]
    contestants, macs = [], {}
    for label, text, rows, columns, a_pair_bytes in tiles:
        contestant, macs[label] = tile_contestant(label, text, rows, columns, a_pair_bytes, args.k, calls)
        contestants.append(contestant)
    timings = interleave(contestants, args.rounds, 3, warmup=2)
    for label, t in timings.items():
        print(f"{label:>18}: {macs[label] / t.median / 1e9:.1f} GMAC/s", flush=True)


if __name__ == "__main__":
    main()
