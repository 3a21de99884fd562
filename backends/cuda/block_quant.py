"""The block-quantized GEMM (MatMulNBits, `BlockQuantGemmSpec`) as CUDA kernels that read the 4- and
8-bit codes as stored.

A GEMV is what MatMulNBits mostly computes (a decoder's step: one row of A per token), and it is
bound by reading B. The loop nest gives each output one thread that walks its column's bytes alone
(neighbouring threads 2 KB apart: nothing coalesces, and a row of A keeps only N threads busy), so
the target runs its own kernel instead, as onnxruntime's CUDA kernels do:
- one warp per column of B and up to 4 rows of A (`column_warps.py`): the lanes take the column's blocks in
  turn, each loading its block's codes 16 (or 8) bytes at a time and unpacking them in registers,
  so a warp reads 512 consecutive bytes of a 4-bit column per step, and every code is widened once
  for all the warp's rows; the lanes' sums meet through `__shfl_xor_sync`, lane 0 stores them
  (plus the bias).
- accuracy level 0 to 3 (float32 A): each code dequantized to float32 as (code - zero) * scale, the
  value onnxruntime's float kernels multiply, then multiplied and added into float32 sums.
- accuracy level 4 (int8 A): first a launch quantizes A per block to int8 (one warp a block of a
  row: max|a| by shuffles, scale max|a| / 127, codes round_half_even(a * (127 / max|a|)), as MLAS
  does), with each block's sum of codes; then the GEMV sums each block's products as integers with
  `__dp4a` (four int8 products a instruction) and adds the block's sum, converted to float32 and
  scaled by scale_a * scale_b, to the column's total: the arithmetic the loop nest and onnxruntime
  define. `__dp4a` multiplies signed bytes, so 8-bit codes (0..255) are read as code - 128 (a xor
  of the sign bits) and the zero point moves by 128 in the correction term:
  sum qa (code - zero) = dot(qa, code - 128) + (128 - zero) * sum qa. 4-bit codes are bytes already
  once split into their low and high nibbles (k even and odd in each group of 8), so the
  quantizing launch stores A's codes of each group of 8 k evens first to line up with them.

B is packed (`pack_block_quant`) as the node stores it, [N, blocks, blob] codes (low bits first),
then the float32 scales [N, blocks], then the zero point codes one a byte (with zero points): for
4-bit blocks of 32, 5.25 bits a weight.
"""

from __future__ import annotations

import numpy as np

from backends.cuda.column_warps import LANE_SUM, WARPS, column_launch, column_prologue, rows_per_warp
from ir.loops.contraction import BlockQuantGemmSpec, BlockQuantWeight, Scratch, WeightLayout
from ir.loops.program import Intrinsic

KERNEL_BITS = (4, 8)
QUANTIZE_WARPS = 8   # blocks of A per block of the quantizing launch, one warp each


DP4A_ARCH = 61       # __dp4a: sm_61 and newer


def block_quant_fits(spec: BlockQuantGemmSpec, archs: tuple[str, ...]) -> bool:
    """4- and 8-bit codes in blocks of a multiple of 16 (onnxruntime's block sizes are powers of two
    of at least 16): a block's codes are whole 8-byte words; a bias is the only epilogue; int8 A
    where every architecture has `__dp4a`."""
    return (spec.bits in KERNEL_BITS and spec.block % 16 == 0 and not spec.epilogue.residual
            and spec.epilogue.activation is None
            and (not spec.int8_a or all(int(arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz")) >= DP4A_ARCH
                                        for arch in archs)))


def weight_layout(spec: BlockQuantGemmSpec) -> WeightLayout:
    return WeightLayout(f"_q{spec.bits}_cuda_blocks")


def _blocks(spec: BlockQuantGemmSpec) -> int:
    return -(-spec.k // spec.block)


def _blob(spec: BlockQuantGemmSpec) -> int:
    """Bytes of one column's block of codes."""
    return spec.block * spec.bits // 8


def pack_block_quant(spec: BlockQuantGemmSpec, weight: BlockQuantWeight) -> np.ndarray:
    """The codes [N, blocks, blob] (padding past K is code 0), the scales, the zero point codes."""
    n, blocks = spec.n, _blocks(spec)
    codes = np.zeros((n, blocks * spec.block), np.uint8)
    codes[:, :spec.k] = weight.codes
    if spec.bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    parts = [codes.reshape(-1), np.ascontiguousarray(weight.scales, "<f4").reshape(-1).view(np.uint8)]
    if spec.zero_points:
        parts.append(np.ascontiguousarray(weight.zeros, np.uint8).reshape(-1))
    return np.concatenate(parts)


def scratch(spec: BlockQuantGemmSpec) -> tuple[Scratch, ...]:
    """With int8 A: its codes (each row padded to whole blocks), each block's scale and code sum."""
    if not spec.int8_a:
        return ()
    cells = spec.m * _blocks(spec)
    return (Scratch("a", "_q8", cells * spec.block // 4), Scratch("a", "_q8_scales", cells),
            Scratch("a", "_q8_sums", cells))


def launches(name: str, spec: BlockQuantGemmSpec) -> list[tuple[str, list[int], list[int], int]]:
    """(kernel, grid, block, useful threads) of each launch, in order."""
    gemv = column_launch(name, spec.m, spec.n)
    if not spec.int8_a:
        return [gemv]
    warps = spec.m * _blocks(spec)
    quantize = (f"{name}_quantize_a", [-(-warps // QUANTIZE_WARPS), 1, 1], [32 * QUANTIZE_WARPS, 1, 1], 32 * warps)
    return [quantize, gemv]


def render_block_quant(r, unit, call: Intrinsic) -> str:
    """The launches' functions (`launches` order) for one `Intrinsic` of a `BlockQuantGemmSpec`;
    `r` is the CudaRenderer (pointers and names)."""
    spec, ops = call.spec, call.operands
    r._names = {}
    names = {"a": ops.a, "b": ops.b, "y": ops.out, "bias": ops.bias}
    names.update(zip(("codes_a", "scales_a", "sums_a"), ops.scratch))
    c = {key: r.buffer_name(buf.storage) for key, buf in names.items() if buf is not None}
    functions = []
    if spec.int8_a:
        functions.append(_quantize_a(r, unit, call, c))
    functions.append(_gemv(r, unit, call, c))
    return "\n".join(functions)


def _mask_k(spec: BlockQuantGemmSpec, k: str, value: str, zero: str) -> str:
    """`value` where `k` is inside K; only the last block of a K that is not whole blocks has others."""
    return value if spec.k % spec.block == 0 else f"({k} < {spec.k} ? {value} : {zero})"


def _quantize_a(r, unit, call: Intrinsic, c: dict) -> str:
    spec = call.spec
    blocks = _blocks(spec)
    name = launches(unit.name, spec)[0][0]
    lines = r.header(name, unit.kernel, [call], 32 * QUANTIZE_WARPS)
    lines[1] = f"  // {unit.kernel.op_type} ({unit.kernel.name}): A to int8 per block of {spec.block}, one warp a block"
    # 4-bit codes pair with A's k in each group of 8 as even k (low nibbles), then odd k (high nibbles).
    place = "(t & ~7) | ((t & 1) << 2) | ((t & 7) >> 1)" if spec.bits == 4 else "t"
    a_at = f"{c['a']}[row * {spec.k} + k]"
    lines += ["  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;",
              "  const int lane = threadIdx.x & 31;",
              f"  if (warp >= {spec.m * blocks}LL) return;   // whole warps leave together",
              f"  const int row = (int)(warp / {blocks}), blk = (int)(warp % {blocks});",
              f"  signed char* __restrict__ codes = (signed char*){c['codes_a']} + (long long)row * {blocks * spec.block} + blk * {spec.block};",
              "  float amax = 0.0f;",
              f"  for (int t = lane; t < {spec.block}; t += 32) {{",
              f"    const int k = blk * {spec.block} + t;",
              f"    amax = cx_max(amax, {_mask_k(spec, 'k', f'fabsf({a_at})', '0.0f')});",
              "  }",
              "  for (int offset = 16; offset > 0; offset >>= 1) amax = cx_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));",
              "  const float inverse = amax == 0.0f ? 0.0f : 127.0f / amax;",
              "  int sum = 0;",
              f"  for (int t = lane; t < {spec.block}; t += 32) {{",
              f"    const int k = blk * {spec.block} + t;",
              f"    const int q = {_mask_k(spec, 'k', f'cx_f2i((double)rintf({a_at} * inverse))', '0')};",
              f"    codes[{place}] = (signed char)q;",
              "    sum += q;",
              "  }",
              "  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);",
              "  if (lane == 0) {",
              f"    {c['scales_a']}[warp] = amax / 127.0f;",
              f"    ((int*){c['sums_a']})[warp] = sum;",
              "  }", "}"]
    return "\n".join(lines) + "\n"


def _gemv(r, unit, call: Intrinsic, c: dict) -> str:
    spec = call.spec
    blocks, blob, rows = _blocks(spec), _blob(spec), rows_per_warp(spec.m)
    vector, words = ("uint4", ("x", "y", "z", "w")) if blob % 16 == 0 else ("uint2", ("x", "y"))
    per_word = 32 // spec.bits
    codes_at, scales_at = 0, spec.n * blocks * blob
    zero = (f"(int){c['b']}[{scales_at + 4 * spec.n * blocks} + col * {blocks} + blk]" if spec.zero_points
            else str(2 ** (spec.bits - 1)))
    arithmetic = "int8 A, __dp4a" if spec.int8_a else "float32 A"
    lines = r.header(unit.name, unit.kernel, [call], 32 * WARPS)
    lines[1] = (f"  // {unit.kernel.op_type} ({unit.kernel.name}): {spec.bits}-bit blocks of {spec.block}, {arithmetic}; "
                "one warp a column, its lanes taking the blocks in turn")
    lines += column_prologue(spec.m, spec.n, [f"  const float* __restrict__ scales = (const float*)({c['b']} + {scales_at});"])
    lines += [f"  for (int blk = lane; blk < {blocks}; blk += 32) {{",
              f"    const float scale = scales[col * {blocks} + blk];",
              f"    const int zero = {zero};",
              f"    const {vector}* __restrict__ stored = (const {vector}*)({c['b']} + {codes_at} + "
              f"(long long)col * {blocks * blob} + blk * {blob});"]
    if spec.int8_a:
        lines += _dp4a_block(spec, c, rows, vector, words)
    else:
        lines += _float_block(spec, c, rows, vector, words, per_word)
    bias = f" + {c['bias']}[col]" if spec.epilogue.bias else ""
    lines += ["  }",
              f"  for (int r = 0; r < {rows}; ++r) {{",
              f"    {LANE_SUM}",
              f"    if (lane == 0 && row0 + r < {spec.m}) {c['y']}[(long long)(row0 + r) * {spec.n} + col] = acc[r]{bias};",
              "  }", "}"]
    return "\n".join(lines) + "\n"


def _unpacked(vector_words: tuple[str, ...]) -> str:
    return f"const unsigned int word[{len(vector_words)}] = {{{', '.join('q.' + w for w in vector_words)}}};"


def _float_block(spec, c: dict, rows: int, vector: str, words: tuple[str, ...], per_word: int) -> list[str]:
    """float32 A: each code dequantized once, then multiplied into every row's sum."""
    step = len(words) * per_word
    a = f"{c['a']}[row[r] * {spec.k} + k]"
    return [f"    for (int v = 0; v < {spec.block // step}; ++v) {{",
            "      const " + vector + " q = stored[v];",
            "      " + _unpacked(words),
            "#pragma unroll",
            f"      for (int t = 0; t < {step}; ++t) {{",
            f"        const int k = blk * {spec.block} + v * {step} + t;",
            f"        const int code = (int)((word[t / {per_word}] >> ({spec.bits} * (t % {per_word}))) & {2 ** spec.bits - 1}u);",
            "        const float w = (float)(code - zero) * scale;",
            "#pragma unroll",
            f"        for (int r = 0; r < {rows}; ++r) acc[r] = fmaf({_mask_k(spec, 'k', a, '0.0f')}, w, acc[r]);",
            "      }",
            "    }"]


def _dp4a_block(spec, c: dict, rows: int, vector: str, words: tuple[str, ...]) -> list[str]:
    """int8 A: the block's integer sum per row, four products a `__dp4a`, then scaled once."""
    blocks = _blocks(spec)
    k_per_vector = len(words) * 32 // spec.bits
    lines = [f"    int dot[{rows}];",
             f"    for (int r = 0; r < {rows}; ++r) dot[r] = 0;",
             f"    for (int v = 0; v < {spec.block // k_per_vector}; ++v) {{",
             "      const " + vector + " q = stored[v];",
             "      " + _unpacked(words),
             "#pragma unroll",
             f"      for (int t = 0; t < {len(words)}; ++t) {{"]
    qa = f"((const int*){c['codes_a']})[(row[r] * {blocks * spec.block} + blk * {spec.block}) / 4 + "
    if spec.bits == 4:
        lines += ["        const int low = (int)(word[t] & 0x0f0f0f0fu), high = (int)((word[t] >> 4) & 0x0f0f0f0fu);",
                  "#pragma unroll",
                  f"        for (int r = 0; r < {rows}; ++r) dot[r] = __dp4a({qa}2 * (v * {len(words)} + t) + 1], high, "
                  f"__dp4a({qa}2 * (v * {len(words)} + t)], low, dot[r]));"]
        offset = 0
    else:
        lines += ["        const int signed_codes = (int)(word[t] ^ 0x80808080u);   // code - 128 in each byte",
                  "#pragma unroll",
                  f"        for (int r = 0; r < {rows}; ++r) dot[r] = __dp4a({qa}v * {len(words)} + t], signed_codes, dot[r]);"]
        offset = 128
    at = f"row[r] * {blocks} + blk"
    lines += ["      }", "    }",
              f"    for (int r = 0; r < {rows}; ++r) {{",
              f"      const int total = dot[r] + ({offset} - zero) * ((const int*){c['sums_a']})[{at}];",
              f"      acc[r] += (float)total * ({c['scales_a']}[{at}] * scale);",
              "    }"]
    return lines
