"""A GEMM whose constant B is stored narrow (`GemmSpec.b_format` "bf16", "fp16" or "int8", the
weights of a `--variants` build, ir/loops/narrow_weights.py) as a CUDA kernel that reads the narrow
bytes and widens them in registers.

Without it, the variant's graph widens the whole weight to float32 in a kernel of its own on every
call and the product then reads the float32 copy: more bytes moved than the exact CU's, where the
point of the narrow weight is to move fewer. A product of few rows (a decoder's step) is bound by
reading B, so the kernel is block_quant's GEMV: one warp per column of B and up to 4 rows
of A, the lanes taking the column's 16-byte vectors in turn (a warp reads 512 consecutive bytes a
step), each value widened once for all the warp's rows; the lanes' sums meet through
`__shfl_xor_sync`, lane 0 applies the epilogue and stores. More rows take more warps over the same
column (the grid's y), each reading B again, from L2 after the first.

Only products of fewer than `ROW_LIMIT` rows are offered: from 16 rows on a product fills the
16 x 16 tiles the loop-nest renderer gives float32 contractions (and the tensor cores a narrow
variant rounds its other operand for, build.py), which read each B tile once for 16 rows or more,
where this kernel's warps would each read every row of A again for each column.

Widening, exact for every value a kernel is given (integer ops and at most one float op, which run
at full rate on every lane, and which cuda-sim compiles unchanged):
- bf16: the pattern is the top half of its float32: a shift (or a mask for the high half of a word).
- fp16: the pattern placed in the top half, shifted right by 3 with its sign: exponent and mantissa
  land where a float32's are with the exponent 112 short, and clearing the sign's 3 copies gives
  2^-112 times the half's value, which times 2^112 is exact, subnormal halves included (nothing here
  flushes subnormals). A half of exponent 31 would come out finite: Inf and NaN constants are never
  read narrow (ir/loops/narrow_weights.py).
- int8: the code with its sign bit flipped (code + 128, 0..255) as the low mantissa byte of 2^23,
  minus 2^23 + 128: the code as a float32, with no conversion instruction.
int8 sums sum_k a[k] * code[k] and multiplies the sum by the column's scale once, before the bias,
as ir/loops/narrow_weights.py allows (the widened graph scales each product instead).

B is packed (`pack_narrow_columns`) as its N columns, each column's K values contiguous and padded
with zeros to whole 16-byte vectors (2 bytes a value for bf16 and fp16, 1 for int8), then for int8
the N float32 column scales. A past K (the last vector's padding) reads as 0.
"""

from __future__ import annotations

import numpy as np

from backends.cuda.column_warps import LANE_SUM, WARPS, column_launch, column_prologue, rows_per_warp
from backends.cuda.spelling import number
from ir.errors import UnsupportedError
from ir.loops.contraction import GemmSpec, WeightLayout
from ir.loops.narrow_weights import FORMATS, NarrowWeight
from ir.loops.program import Intrinsic

ROW_LIMIT = 16       # products of this many rows or more stay loop nests (see the module docstring)
VECTOR_BYTES = 16    # one uint4 load a lane
VALUE_BYTES = {"bf16": 2, "fp16": 2, "int8": 1}
ACTIVATIONS = (None, "relu", "gelu")


def narrow_gemv_fits(spec: GemmSpec) -> bool:
    return (spec.b_format in FORMATS and spec.constant_b and spec.batch == 1 and 0 < spec.m < ROW_LIMIT
            and spec.epilogue.activation in ACTIVATIONS)


def weight_layout(spec: GemmSpec) -> WeightLayout:
    return WeightLayout(f"_{spec.b_format}_cuda_columns")


def _per_vector(spec: GemmSpec) -> int:
    return VECTOR_BYTES // VALUE_BYTES[spec.b_format]


def _vectors(spec: GemmSpec) -> int:
    """16-byte vectors in one column."""
    return -(-spec.k // _per_vector(spec))


def pack_narrow_columns(spec: GemmSpec, weight: NarrowWeight) -> np.ndarray:
    """The columns [N][K padded], little-endian, then the int8 scales; bytes."""
    codes = np.asarray(weight.codes)
    bits = codes.view(np.uint8) if weight.format == "int8" else codes.view(np.uint16)
    columns = bits if spec.trans_b else bits.T           # [N, K]
    padded = np.zeros((spec.n, _vectors(spec) * _per_vector(spec)), dtype=bits.dtype.newbyteorder("<"))
    padded[:, :spec.k] = columns
    parts = [padded.reshape(-1).view(np.uint8)]
    if weight.format == "int8":
        parts.append(np.ascontiguousarray(weight.column_scale, "<f4").view(np.uint8))
    return np.concatenate(parts)


def launches(name: str, spec: GemmSpec) -> list[tuple[str, list[int], list[int], int]]:
    """(kernel, grid, block, useful threads) of its one launch."""
    return [column_launch(name, spec.m, spec.n)]


def render_narrow_gemv(r, unit, call: Intrinsic) -> str:
    """The kernel function for one `Intrinsic` of a narrow-B `GemmSpec`; `r` is the CudaRenderer
    (pointers and names)."""
    spec, ops = call.spec, call.operands
    if spec.epilogue.activation not in ACTIVATIONS:
        raise UnsupportedError(f"{unit.kernel.op_type} ({unit.kernel.name}): the CUDA narrow-weight GEMV has no "
                               f"{spec.epilogue.activation!r} epilogue")
    r._names = {}
    names = {"a": ops.a, "b": ops.b, "y": ops.out, "bias": ops.bias, "residual": ops.residual}
    c = {key: r.buffer_name(buf.storage) for key, buf in names.items() if buf is not None}
    rows, per_vector, vectors = rows_per_warp(spec.m), _per_vector(spec), _vectors(spec)
    column_bytes = vectors * VECTOR_BYTES
    lines = r.header(unit.name, unit.kernel, [call], 32 * WARPS)
    transposes = f"{'A^T' if spec.trans_a else 'A'} @ {'B^T' if spec.trans_b else 'B'}"
    lines[1] = (f"  // {unit.kernel.op_type} ({unit.kernel.name}): {transposes}, B stored {spec.b_format}; "
                "one warp a column, its lanes taking the 16-byte vectors in turn")
    lines += column_prologue(spec.m, spec.n,
                             [f"  const uint4* __restrict__ column = (const uint4*)({c['b']} + (long long)col * {column_bytes});"])
    lines += [f"  for (int v = lane; v < {vectors}; v += 32) {{",
              "    const uint4 q = column[v];",
              "    const unsigned int word[4] = {q.x, q.y, q.z, q.w};",
              "#pragma unroll",
              f"    for (int g = 0; g < {per_vector // 4}; ++g) {{   // four values of B a step",
              f"      const int k = v * {per_vector} + 4 * g;",
              *[f"      {line}" for line in _widened_four(spec.b_format)],
              "#pragma unroll",
              f"      for (int r = 0; r < {rows}; ++r) {{",
              *[f"        {line}" for line in _four_of_a(spec, c["a"])],
              "        acc[r] = fmaf(x3, w3, fmaf(x2, w2, fmaf(x1, w1, fmaf(x0, w0, acc[r]))));",
              "      }",
              "    }",
              "  }"]
    lines += [f"  for (int r = 0; r < {rows}; ++r) {{",
              f"    {LANE_SUM}",
              f"    if (lane != 0 || row0 + r >= {spec.m}) continue;",
              f"    const long long at = (long long)(row0 + r) * {spec.n} + col;",
              *[f"    {line}" for line in _epilogue(spec, c, column_bytes)],
              f"    {c['y']}[at] = y;",
              "  }", "}"]
    return "\n".join(lines) + "\n"


def _widened_four(format: str) -> list[str]:
    """w0..w3: values 4g .. 4g + 3 of the vector `word[4]` as float32."""
    if format == "int8":
        # code + 128 as the low byte of 2^23's mantissa: 2^23 + 128 + code, exactly.
        return ["const unsigned int flipped = word[g] ^ 0x80808080u;",
                *[f"const float w{j} = __int_as_float((int)(0x4b000000u | ((flipped >> {8 * j}) & 0xffu))) - 8388736.0f;"
                  for j in range(4)]]
    tops = ["(word[2 * g] << 16)", "(word[2 * g] & 0xffff0000u)", "(word[2 * g + 1] << 16)", "(word[2 * g + 1] & 0xffff0000u)"]
    if format == "bf16":
        return [f"const float w{j} = __int_as_float((int){top});" for j, top in enumerate(tops)]
    two_to_112 = number(2.0 ** 112, "f32")
    return [f"const float w{j} = __int_as_float((int)((unsigned int)((int){top} >> 3) & 0x8fffe000u)) * {two_to_112};"
            for j, top in enumerate(tops)]


def _four_of_a(spec: GemmSpec, a: str) -> list[str]:
    """x0..x3: A[row[r], k .. k + 3], 0 past K (B's padding). One 16-byte load where A's rows are whole
    vectors (K a multiple of 4, A not transposed), else four loads."""
    if not spec.trans_a and spec.k % 4 == 0:
        load = f"*(const float4*)&{a}[(long long)row[r] * {spec.k} + k]"
        if spec.k % (VECTOR_BYTES // VALUE_BYTES[spec.b_format]) != 0:
            load = f"(k < {spec.k} ? {load} : make_float4(0.0f, 0.0f, 0.0f, 0.0f))"
        return [f"const float4 x = {load};", "const float x0 = x.x, x1 = x.y, x2 = x.z, x3 = x.w;"]
    at = (lambda k: f"{a}[(long long)({k}) * {spec.m} + row[r]]") if spec.trans_a else \
        (lambda k: f"{a}[(long long)row[r] * {spec.k} + {k}]")
    return [f"const float x{j} = k + {j} < {spec.k} ? {at(f'k + {j}')} : 0.0f;" for j in range(4)]


def _epilogue(spec: GemmSpec, c: dict, column_bytes: int) -> list[str]:
    """y: the sum (times the int8 column's scale), plus the bias, plus the residual, activated."""
    value = "acc[r]"
    if spec.b_format == "int8":
        value += f" * ((const float*)({c['b']} + {spec.n * column_bytes}))[col]"
    lines = [f"float y = {value};"]
    if spec.epilogue.bias:
        lines.append(f"y += {c['bias']}[col];")
    if spec.epilogue.residual:
        lines.append(f"y += {c['residual']}[at];")
    if spec.epilogue.activation == "relu":
        lines.append("y = cx_max(y, 0.0f);")
    elif spec.epilogue.activation == "gelu":
        lines.append("y = 0.5f * y * (1.0f + erff(y * 0.70710678118654752f));")
    return lines
