"""onnxruntime's MatMulNBits (com.microsoft): Y = A @ B^T [+ bias] with B quantized in blocks along K,
the weight-only format int4 language models ship in (onnxruntime-genai's model builder,
`onnxruntime.quantization.matmul_nbits_quantizer`, transformers.js's q4 files).

The node stays a contraction of its own, its weight narrow: a target whose kernels read the blocks
(`BlockQuantGemmSpec`) packs the codes, scales and zero points as they are, so a 4-bit weight holds
about an eighth of float32's bytes in its CU; the loop nests every target has read the codes from
their bytes too. B is [N, blocks, blob] bytes of `bits`-bit little-endian bit fields (low bits
first), one scale per (column, block), zero points packed the same way, each column's starting on a
byte (none: the middle code 2^(bits-1)).

`accuracy_level` says what onnxruntime computes, and Cortex computes the same:
- 0 to 3 (onnxruntime's CPU kernels compute all three in float32): float32 A times B dequantized
  to float32, (code - zero) * scale rounded once, exactly what a compile-time dequantization gives;
- 4 (onnxruntime-genai's builder writes it for CPU int4 models): A quantized per block to int8
  and integer dot products (MLAS's CompInt8; the contract is stated on `BlockQuantGemmSpec`).

Forms the blocks cannot express stay the float32 product they define: with `g_idx` (a block per
k chosen by index) or float zero points, the expansion dequantizes B at compile time; with g_idx
and packed uint8 zero points (which onnxruntime ignores) the node is refused in one line.
"""

from __future__ import annotations

import numpy as np

from ir.errors import NotExpanded, UnsupportedError
from ir.graph import Node
from ir.loops.contraction import (BlockQuantGemmSpec, BlockQuantWeight, ContractionOperands, EpilogueSpec,
                                  dequantized_codes)
from ir.loops.expr import binary, cast, lt, maximum, select, unary
from ir.ops.function_body import Body
from ir.ops.registry import CONTRACTION, lowering, output_elements, register, static_dim

DOMAIN = "com.microsoft"
INT8_ACCURACY = 4           # accuracy_level at which onnxruntime quantizes A to int8
BYTE_ALIGNED_BITS = (2, 4, 8)   # codes that never straddle a byte: the loop nests read them in place


def nbits_attributes(node: Node) -> tuple[int, int, int, int, int]:
    """(K, N, bits, block_size, accuracy_level)."""
    attrs = node.attrs
    return (int(attrs["K"]), int(attrs["N"]), int(attrs.get("bits", 4)), int(attrs["block_size"]),
            int(attrs.get("accuracy_level", 0)))


def _input(node: Node, i: int):
    return node.inputs[i] if i < len(node.inputs) and node.inputs[i] is not None else None


def _kept_narrow(node: Node) -> bool:
    """Whether the blocks express this node's B: constant codes, scales and (uint8) zero points and
    no g_idx."""
    b, scales, zeros = _input(node, 1), _input(node, 2), _input(node, 3)
    if _input(node, 4) is not None or b is None or scales is None or not (b.is_const and scales.is_const):
        return False
    return zeros is None or (zeros.is_const and np.asarray(zeros.const).dtype == np.uint8)


def block_quant_weight(node: Node) -> BlockQuantWeight:
    """The node's B as codes [N, K], scales [N, blocks] and zero point codes [N, blocks] (or None)."""
    k, n, bits, block, _ = nbits_attributes(node)
    blocks = -(-k // block)
    packed = np.asarray(node.inputs[1].const)
    if not 2 <= bits <= 8 or packed.dtype != np.uint8 or packed.size != n * blocks * (block * bits // 8):
        raise UnsupportedError(f"{node.describe()}: MatMulNBits B of shape {list(packed.shape)} ({packed.dtype}) "
                               f"does not hold N={n} x {blocks} blocks of {block} {bits}-bit codes")
    codes = _bit_fields(packed.reshape(n, -1), bits)[:, :k].astype(np.uint8)
    scales = np.asarray(node.inputs[2].const).astype(np.float32).reshape(n, blocks)
    zeros = _input(node, 3)
    zero_codes = None if zeros is None else _bit_fields(np.asarray(zeros.const).reshape(n, -1), bits)[:, :blocks]
    return BlockQuantWeight(codes, scales, None if zero_codes is None else zero_codes.astype(np.uint8), bits)


def _bit_fields(rows: np.ndarray, bits: int) -> np.ndarray:
    """The `bits`-wide unsigned fields of each row of bytes, low bits first."""
    flat = np.unpackbits(rows, axis=1, bitorder="little")
    fields = flat[:, :flat.shape[1] // bits * bits].reshape(rows.shape[0], -1, bits).astype(np.int32)
    return (fields << np.arange(bits, dtype=np.int32)).sum(axis=2)


def dequantized_blocks(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                       bits: int, block: int, g_idx: np.ndarray | None = None) -> np.ndarray:
    """MatMulNBits' B as [N, K] in the scales' type: (code - zero) * scale, rounded to float32 once,
    zero points packed (uint8) or float (None: the middle code), blocks by `g_idx` when given."""
    blocks = -(-k // block)
    codes = _bit_fields(packed.reshape(n, -1), bits)[:, :k].astype(np.float32)
    if zero_points is None:
        zero_values = np.full((n, blocks), 2 ** (bits - 1), np.float32)
    elif zero_points.dtype == np.uint8:
        zero_values = _bit_fields(zero_points.reshape(n, -1), bits)[:, :blocks].astype(np.float32)
    else:
        zero_values = zero_points.reshape(n, blocks).astype(np.float32)
    group = g_idx.astype(np.int64).reshape(k) if g_idx is not None else np.arange(k) // block
    return dequantized_codes(codes, scales.reshape(n, blocks), zero_values, group).astype(scales.dtype)


def _expansion(node):
    """Only the forms the blocks cannot express: B dequantized at compile time to A's float type
    (onnxruntime's kernel multiplies float A by the dequantized blocks there too)."""
    body = Body(node, ("A", "B", "scales", "zero_points", "g_idx", "bias"))
    if _kept_narrow(node):
        raise NotExpanded(f"{node.describe()}: kept narrow (the kernels read its blocks)")
    constant = {i: body.const_input(i) for i in range(1, 5) if body.present(i)}
    if any(value is None for value in constant.values()):
        raise NotExpanded(f"{node.describe()}: MatMulNBits with a weight, scale or zero point computed at "
                          "run time is not supported")
    if constant.get(4) is not None and constant.get(3) is not None and constant[3].dtype == np.uint8:
        # onnxruntime's kernel reads no packed zero point once g_idx is given (it uses the middle code).
        raise NotExpanded(_G_IDX_WITH_PACKED_ZEROS.format(node=node.describe()))
    k, n, bits, block, _ = nbits_attributes(node)
    weight = dequantized_blocks(constant[1], constant[2], constant.get(3), k, n, bits, block, constant.get(4))
    y = body.op("MatMul", "A", body.constant(weight.T, weight.dtype), out=None if body.present(5) else "Y")
    if body.present(5):
        body.op("Add", y, "bias", out="Y")
    return body.function(("Y",))


_G_IDX_WITH_PACKED_ZEROS = ("{node}: MatMulNBits with g_idx and packed uint8 zero points is not supported "
                            "(onnxruntime ignores those zero points); give float zero points")


def _shapes(node: Node, opset: int) -> list:
    a = node.inputs[0]
    if a is None or a.shape is None:
        return [None]
    return [(a.dtype, (*a.shape[:-1], int(node.attrs["N"])))]


def _flops(node: Node) -> int:
    return 2 * output_elements(node) * static_dim(node.inputs[0].shape[-1])


def _slice_channels(node: Node, lo: int, hi: int) -> tuple[dict[int, np.ndarray], dict]:
    """Columns [lo, hi) of the product: B's, the scales' and the zero points' rows of those
    columns (each column's blocks are contiguous in all three), and N."""
    _, n, _, _, _ = nbits_attributes(node)
    parts = {}
    for i in (1, 2, 3):
        v = _input(node, i)
        if v is not None:
            rows = np.asarray(v.const).reshape(n, -1)[lo:hi]
            parts[i] = np.ascontiguousarray(rows.reshape((hi - lo, *np.asarray(v.const).shape[1:])) if i == 1
                                            else rows.reshape(-1))
    return parts, {"N": hi - lo}


register("MatMulNBits", domain=DOMAIN, kind=CONTRACTION, weight_input=1, weight_axis=lambda node: 0,
         output_axis=lambda node: -1, shape_rule=_shapes, flops=_flops, expansion=_expansion,
         slice_channels=_slice_channels, lowered_when=_kept_narrow,
         quantizes_activations=lambda node: nbits_attributes(node)[4] == INT8_ACCURACY)


# -- lowering to loop nests --------------------------------------------------------------------
@lowering("loops", "MatMulNBits", domain=DOMAIN)
def _matmul_nbits(b, node):
    k, n, bits, block, accuracy = nbits_attributes(node)
    av = node.inputs[0]
    m = int(np.prod(av.shape[:-1], dtype=np.int64))
    weight = block_quant_weight(node)
    bias = b.input(node, 5)
    spec = BlockQuantGemmSpec(m, n, k, bits, block, weight.zeros is not None, accuracy == INT8_ACCURACY,
                              EpilogueSpec(bias is not None))
    if b.offers(spec):
        packed = b.contraction_weight(spec, node.inputs[1], weight)
        b.call_contraction(spec, ContractionOperands(b.buffer(av).view((m, k)), packed, b.output(node).view((m, n)), bias),
                           av.name, node.inputs[1].name)
        return
    _loops(b, node, spec, weight)


def _loops(b, node, spec: BlockQuantGemmSpec, weight: BlockQuantWeight) -> None:
    """The product as loop nests over the codes as stored (bits 2, 4 and 8; others one code a byte)."""
    m, n, k, bits, block = spec.m, spec.n, spec.k, spec.bits, spec.block
    blocks = -(-k // block)
    a = b.input(node, 0).view((m, k))
    y = b.output(node).view((m, n))
    bias = b.input(node, 5)
    scales = b.constant(weight.scales, node.inputs[2].name + "_scales")
    zeros = b.constant(weight.zeros, node.inputs[3].name + "_codes") if weight.zeros is not None else None
    if bits in BYTE_ALIGNED_BITS:
        stored = b.constant(np.asarray(node.inputs[1].const).reshape(n, -1), node.inputs[1].name)
        per_byte = 8 // bits
    else:
        stored, per_byte = b.constant(weight.codes, node.inputs[1].name + "_codes"), 1
    blob = -(-block // per_byte)

    def code(j, kk):
        """The code of column j at k `kk`, as i32."""
        if per_byte == 1:
            return cast(stored[(j, kk)], "i32")
        within = binary("rem", kk, block)
        byte = stored[(j, binary("div", kk, block) * blob + binary("div", within, per_byte))]
        shift = binary("rem", within, per_byte) * bits
        return binary("and", binary("shr", cast(byte, "i32"), shift), 2 ** bits - 1)

    def zero(j, blk):
        return cast(zeros[(j, blk)], "i32") if zeros is not None else 2 ** (bits - 1)

    if not spec.int8_a:
        with b.loop(m, "i") as i, b.loop(n, "j") as j:
            acc = b.local("f32", 0.0, "acc")
            with b.loop(k, "k") as kk:
                blk = binary("div", kk, block)
                w = cast(code(j, kk), "f32") - cast(zero(j, blk), "f32")
                b.assign(acc, acc + a[(i, kk)] * (w * scales[(j, blk)]))
            b.store(y, (i, j), acc + bias.at(j) if bias is not None else acc)
        return
    # accuracy level 4: A per block to int8 (MLAS's QuantizeARow_CompInt8), integer sums per block
    codes_a = b.temp("int8", (m, blocks * block), node.inputs[0].name + "_q8")
    scales_a = b.temp("float32", (m, blocks), node.inputs[0].name + "_q8_scales")
    with b.loop(m, "i") as i, b.loop(blocks, "blk") as blk:
        amax = b.local("f32", 0.0, "amax")
        with b.loop(block, "t") as t:
            kk = blk * block + t
            with b.when(lt(kk, k)):
                b.assign(amax, maximum(amax, unary("abs", a[(i, kk)])))
        inverse = b.local("f32", select(binary("eq", amax, 0.0), 0.0, 127.0 / amax), "inverse")
        b.store(scales_a, (i, blk), amax / 127.0)
        with b.loop(block, "t") as t:
            kk = blk * block + t
            b.store(codes_a, (i, kk), select(lt(kk, k), unary("nearest", a[(i, select(lt(kk, k), kk, 0))] * inverse), 0.0))
    with b.loop(m, "i") as i, b.loop(n, "j") as j:
        acc = b.local("f32", 0.0, "acc")
        with b.loop(blocks, "blk") as blk:
            total = b.local("i32", 0, "total")
            with b.loop(block, "t") as t:
                kk = blk * block + t
                with b.when(lt(kk, k)):
                    b.assign(total, total + cast(codes_a[(i, kk)], "i32") * (code(j, kk) - zero(j, blk)))
            b.assign(acc, acc + cast(total, "f32") * (scales_a[(i, blk)] * scales[(j, blk)]))
        b.store(y, (i, j), acc + bias.at(j) if bias is not None else acc)
