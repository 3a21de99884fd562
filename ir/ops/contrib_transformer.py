"""onnxruntime's transformer-optimizer ops (domain com.microsoft), each registered with an ONNX
function body over standard ops that the expand-ops pass inlines (see passes/expand_ops.py).

The bodies follow onnxruntime's kernels (onnxruntime/contrib_ops/cpu/bert/), not only the
operator docs, so that a model matches onnxruntime where the docs are silent (defaults, the
optional inputs' forms). Each body is built per node: attributes and which optional inputs are
present are written into its text. Bodies need no shapes (they run before shape inference): sizes
come from Shape ops that fold once the inputs are bound. They are written at opset 17 with ops whose
signatures are the same from opset 17 on; the expand-ops pass reads them at the model's opset,
older ones too (ir/ops/body_opset.py), so axes are constants wherever they can be (an older opset
takes ReduceSum's and Unsqueeze's axes as attributes) and splits are Slices. They are written in the forms the lowering makes
fast: a MatMul of a constant weight followed by its bias Add and then a residual Add (one GEMM with
its epilogue), the erf GELU diamond, the LayerNormalization op.

Attention and MultiHeadAttention are in `contrib_attention`, which uses the helpers here.
"""

from __future__ import annotations

import onnx.parser

from ir.errors import NeedsShapes
from ir.ops.registry import ELEMENTWISE, NORMALIZATION, OTHER, register

DOMAIN = "com.microsoft"
OPSET = 17      # the standard ops the bodies use (LayerNormalization needs 17)


def function(text: str) -> onnx.FunctionProto:
    """A body in ONNX's textual syntax; the header's domain and opset are filled in here."""
    return onnx.parser.parse_function(f'<domain: "{DOMAIN}", opset_import: ["" : {OPSET}]>\n{text}')


def present(node, index: int) -> bool:
    return index < len(node.inputs) and node.inputs[index] is not None


def wanted(node, index: int) -> bool:
    return index < len(node.outputs) and bool(node.outputs[index].name)


def signature(name: str, formals: list[str], node, results: list[str]) -> str:
    """`name (inputs) => (outputs)` with a formal per position the node fills (absent optional inputs
    keep their position and are never read) and the outputs up to the last one the node uses."""
    count = max((j + 1 for j in range(len(results)) if wanted(node, j)), default=1)
    return f"{name} ({', '.join(formals[:len(node.inputs)])}) => ({', '.join(results[:count])})"


def number(value: float) -> str:
    return repr(float(value))


def attr(node, key: str, default):
    return node.attrs.get(key, default)


def gelu_lines(x: str, y: str, prefix: str = "g") -> str:
    """y = (x * 0.5) * (1 + erf(x / sqrt 2)), the diamond `ir/ops/gelu_pattern.py` matches."""
    return f"""
        {prefix}_half = Constant <value_float = 0.5> ()
        {prefix}_one = Constant <value_float = 1.0> ()
        {prefix}_rsqrt2 = Constant <value_float = 0.70710678118654752> ()
        {prefix}_scaled = Mul ({x}, {prefix}_rsqrt2)
        {prefix}_erf = Erf ({prefix}_scaled)
        {prefix}_shifted = Add ({prefix}_erf, {prefix}_one)
        {prefix}_halfx = Mul ({x}, {prefix}_half)
        {y} = Mul ({prefix}_halfx, {prefix}_shifted)"""


def last_axis_halves(x: str, left: str, right: str) -> str:
    """The two halves of `x` along its last axis, as Slices sized from its shape."""
    return f"""
        h_width = Shape <start = -1> ({x})
        h_two = Constant <value_ints = [2]> ()
        h_half = Div (h_width, h_two)
        h_zero = Constant <value_ints = [0]> ()
        h_axis = Constant <value_ints = [-1]> ()
        {left} = Slice ({x}, h_zero, h_half, h_axis)
        {right} = Slice ({x}, h_half, h_width, h_axis)"""


# -- activations ---------------------------------------------------------------------------------
def _gelu(node) -> onnx.FunctionProto:
    return function(f"Gelu (X) => (Y) {{{gelu_lines('X', 'Y')}\n}}")


def _bias_gelu(node) -> onnx.FunctionProto:
    return function(f"BiasGelu (A, B) => (C) {{\n        S = Add (A, B){gelu_lines('S', 'C')}\n}}")


def _fast_gelu(node) -> onnx.FunctionProto:
    """onnxruntime's kernel: 0.5 x (1 + tanh(x (sqrt(2/pi) + 0.044715 sqrt(2/pi) x^2))), x with bias."""
    biased = "S = Add (X, bias)" if present(node, 1) else "S = Identity (X)"
    return function(f"""{signature("FastGelu", ["X", "bias"], node, ["Y"])} {{
        {biased}
        alpha = Constant <value_float = 0.7978845608028654> ()
        beta = Constant <value_float = 0.035677408136300125> ()
        half = Constant <value_float = 0.5> ()
        one = Constant <value_float = 1.0> ()
        square = Mul (S, S)
        cubic = Mul (square, beta)
        inner = Add (cubic, alpha)
        arg = Mul (S, inner)
        t = Tanh (arg)
        shifted = Add (t, one)
        halfx = Mul (S, half)
        Y = Mul (halfx, shifted)
    }}""")


def _quick_gelu(node) -> onnx.FunctionProto:
    alpha = number(attr(node, "alpha", 1.702))
    return function(f"""QuickGelu (X) => (Y) {{
        alpha = Constant <value_float = {alpha}> ()
        scaled = Mul (X, alpha)
        gate = Sigmoid (scaled)
        Y = Mul (X, gate)
    }}""")


def _bias_add(node) -> onnx.FunctionProto:
    return function("""BiasAdd (X, bias, skip) => (Y) {
        biased = Add (X, bias)
        Y = Add (biased, skip)
    }""")


def _bias_split_gelu(node) -> onnx.FunctionProto:
    """The biased input's first half times the GELU of its second half (onnxruntime's CUDA kernel)."""
    return function(f"""BiasSplitGelu (X, bias) => (Y) {{
        S = Add (X, bias){last_axis_halves('S', 'left', 'right')}{gelu_lines('right', 'gated')}
        Y = Mul (left, gated)
    }}""")


# -- matrix product ------------------------------------------------------------------------------
def _fused_matmul(node) -> onnx.FunctionProto:
    """alpha * op(A) @ op(B). transBatch moves an operand's first axis behind its batch axes (to the
    row axis) before transX swaps the last two, as onnxruntime's kernel reads its operands."""
    lines = []
    operands = []
    for name, index, trans, batch in (("A", 0, "transA", "transBatchA"), ("B", 1, "transB", "transBatchB")):
        perm = _fused_matmul_perm(node, index, bool(attr(node, trans, 0)), bool(attr(node, batch, 0)))
        if perm is None:
            operands.append(name)
        else:
            lines.append(f"{name}t = Transpose <perm = [{', '.join(map(str, perm))}]> ({name})")
            operands.append(f"{name}t")
    alpha = float(attr(node, "alpha", 1.0))
    if alpha == 1.0:
        lines.append(f"Y = MatMul ({operands[0]}, {operands[1]})")
    else:
        lines += [f"product = MatMul ({operands[0]}, {operands[1]})",
                  f"alpha = Constant <value_float = {number(alpha)}> ()", "Y = Mul (product, alpha)"]
    return function("FusedMatMul (A, B) => (Y) {\n" + "\n".join(lines) + "\n}")


def _fused_matmul_perm(node, index: int, trans: bool, batch: bool) -> list[int] | None:
    if not trans and not batch:
        return None
    shape = node.inputs[index].shape
    if shape is None:
        raise NeedsShapes(f"{node.describe()}: FusedMatMul with transposed operands needs the rank of "
                               f"input '{node.inputs[index].name}', which is not known")
    rank = len(shape)
    if rank < 2 or (batch and rank < 3):
        return None if not trans or rank < 2 else [*range(rank - 2), rank - 1, rank - 2]
    axes = [*range(1, rank - 1), 0, rank - 1] if batch else list(range(rank))
    if trans:
        axes[-2], axes[-1] = axes[-1], axes[-2]
    return axes


# -- normalisations ------------------------------------------------------------------------------
def _skip_sum(node, bias_index: int) -> str:
    """S = input + bias + skip: the bias Add first, so that a GEMM producing `input` runs both Adds as
    its epilogue (onnxruntime adds skip first; the two orders differ only by rounding)."""
    if present(node, bias_index):
        return "biased = Add (input, bias)\n        S = Add (biased, skip)"
    return "S = Add (input, skip)"


def _skip_layer_norm(node) -> onnx.FunctionProto:
    epsilon = number(attr(node, "epsilon", 1e-12))
    scales = "S, gamma, beta" if present(node, 3) else "S, gamma"
    head = signature("SkipLayerNormalization", ["input", "skip", "gamma", "beta", "bias"], node,
                     ["output", "mean", "inv_std_var", "input_skip_bias_sum"])
    return function(f"""{head} {{
        {_skip_sum(node, 4)}
        output, mean, inv_std_var = LayerNormalization <axis = -1, epsilon = {epsilon}> ({scales})
        input_skip_bias_sum = Identity (S)
    }}""")


def rms_lines(x: str, scale: str, y: str, inv: str, axes: list[int], epsilon: float) -> str:
    """y = x / sqrt(mean(x^2 over `axes`) + epsilon) * scale, and inv = that 1 / sqrt(..) (kept
    dims), as onnxruntime's SimplifiedLayerNormalization computes it. `axes` are constants (see
    `trailing_axes`), so that the body reads at opsets before 13, where ReduceSum takes them as an
    attribute."""
    return f"""
        r_shape = Shape ({x})
        r_start = Constant <value_ints = [{axes[0]}]> ()
        r_big = Constant <value_ints = [9223372036854775807]> ()
        r_dims = Slice (r_shape, r_start, r_big)
        r_count = ReduceProd <keepdims = 0> (r_dims)
        r_countf = Cast <to = 1> (r_count)
        r_square = Mul ({x}, {x})
        r_axes = Constant <value_ints = [{', '.join(map(str, axes))}]> ()
        r_sum = ReduceSum <keepdims = 1> (r_square, r_axes)
        r_mean = Div (r_sum, r_countf)
        r_eps = Constant <value_float = {number(epsilon)}> ()
        r_var = Add (r_mean, r_eps)
        r_root = Sqrt (r_var)
        r_one = Constant <value_float = 1.0> ()
        {inv} = Div (r_one, r_root)
        r_normed = Div ({x}, r_root)
        {y} = Mul (r_normed, {scale})"""


def trailing_axes(node, axis: int) -> list[int]:
    """The axes from `axis` to the last of the node's first input: negative, so that no rank is
    needed, except for an axis counted from the front, which needs the input's rank."""
    if axis < 0:
        return list(range(axis, 0))
    shape = node.inputs[0].shape
    if shape is None:
        raise NeedsShapes(f"{node.describe()}: axis {axis} counted from the front needs the rank of input "
                          f"'{node.inputs[0].name}', which is not known")
    return list(range(axis - len(shape), 0))


def _simplified_layer_norm(node) -> onnx.FunctionProto:
    body = rms_lines("X", "scale", "Y", "inv_std_var", trailing_axes(node, int(attr(node, "axis", -1))),
                     attr(node, "epsilon", 1e-5))
    head = signature("SimplifiedLayerNormalization", ["X", "scale"], node, ["Y", "inv_std_var"])
    return function(f"{head} {{{body}\n}}")


def _skip_simplified_layer_norm(node) -> onnx.FunctionProto:
    """Its `mean` output is zeros in onnxruntime's kernel (the RMS form has no mean); so it is here."""
    body = rms_lines("S", "gamma", "output", "inv_std_var", [-1], attr(node, "epsilon", 1e-12))
    head = signature("SkipSimplifiedLayerNormalization", ["input", "skip", "gamma", "bias"], node,
                     ["output", "mean", "inv_std_var", "input_skip_bias_sum"])
    return function(f"""{head} {{
        {_skip_sum(node, 3)}{body}
        stats = Shape (inv_std_var)
        mean = ConstantOfShape <value = float[1] {{0.0}}> (stats)
        input_skip_bias_sum = Identity (S)
    }}""")


def _embed_layer_norm(node) -> onnx.FunctionProto:
    """word + position (+ segment) embeddings, LayerNormalization; mask_index counts each row's
    mask values equal to 1 (zeros without a mask), as onnxruntime's kernel does."""
    epsilon = number(attr(node, "epsilon", 1e-12))
    if present(node, 8):
        position = "pos = Gather (position_embedding, position_ids)"
    else:
        position = """seq = Shape <start = 1, end = 2> (input_ids)
        zero = Constant <value_ints = [0]> ()
        pos = Slice (position_embedding, zero, seq, zero)"""
    lines = ["word = Gather (word_embedding, input_ids)", position, "wp = Add (word, pos)"]
    if present(node, 1) and present(node, 4):
        lines += ["seg = Gather (segment_embedding, segment_ids)", "S = Add (wp, seg)"]
    else:
        lines.append("S = Identity (wp)")
    lines += [f"output = LayerNormalization <axis = -1, epsilon = {epsilon}> (S, gamma, beta)",
              "embedding_sum = Identity (S)"]
    if present(node, 7):
        lines += ["ones = Constant <value = int32 {1}> ()", "hits = Equal (mask, ones)",
                  "hits32 = Cast <to = 6> (hits)", "row = Constant <value_ints = [1]> ()",
                  "mask_index = ReduceSum <keepdims = 0> (hits32, row)"]
    else:
        lines += ["batch = Shape <start = 0, end = 1> (input_ids)",
                  "mask_index = ConstantOfShape <value = int32[1] {0}> (batch)"]
    head = signature("EmbedLayerNormalization",
                     ["input_ids", "segment_ids", "word_embedding", "position_embedding", "segment_embedding",
                      "gamma", "beta", "mask", "position_ids"], node, ["output", "mask_index", "embedding_sum"])
    return function(head + " {\n" + "\n".join(lines) + "\n}")


register("Gelu", domain=DOMAIN, kind=ELEMENTWISE, expansion=_gelu)
register("BiasGelu", domain=DOMAIN, kind=ELEMENTWISE, expansion=_bias_gelu)
register("FastGelu", domain=DOMAIN, kind=ELEMENTWISE, expansion=_fast_gelu)
register("QuickGelu", domain=DOMAIN, kind=ELEMENTWISE, expansion=_quick_gelu)
register("BiasAdd", domain=DOMAIN, kind=ELEMENTWISE, expansion=_bias_add)
register("BiasSplitGelu", domain=DOMAIN, kind=OTHER, expansion=_bias_split_gelu)
register("FusedMatMul", domain=DOMAIN, kind=OTHER, expansion=_fused_matmul)
register("SkipLayerNormalization", domain=DOMAIN, kind=NORMALIZATION, expansion=_skip_layer_norm)
register("SkipSimplifiedLayerNormalization", domain=DOMAIN, kind=NORMALIZATION, expansion=_skip_simplified_layer_norm)
# onnxruntime defines SimplifiedLayerNormalization in the default domain (version 1), as its optimizer writes it
register("SimplifiedLayerNormalization", kind=NORMALIZATION, expansion=_simplified_layer_norm)
register("EmbedLayerNormalization", domain=DOMAIN, kind=NORMALIZATION, expansion=_embed_layer_norm)
