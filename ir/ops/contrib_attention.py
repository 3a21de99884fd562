"""onnxruntime's Attention (packed QKV weight) as a function body over standard ops, expanded by the
expand-ops pass like the other contrib ops (`contrib_transformer`).

The body follows onnxruntime's CPU kernel (contrib_ops/cpu/bert/attention.cc and
attention_cpu_base.h): Q, K and V are the input times the weight's three column blocks plus the
bias's, split into heads; scores are scale * Q K^T plus the attention bias and the mask; softmax;
times V; heads joined. The weight and bias are sliced (constants, so folding gives three weights)
and each projection is a MatMul with its bias Add, the form the GEMM kernels run with the bias as
their epilogue, as in an exported BERT.

mask_index takes every form the kernel accepts: 1-D lengths [B] (keys at or after the end are
masked) or [2B] (the second half: start positions, keys before the start are masked too), a 2-D
raw 0/1 mask [B, T] and a 3-D one [B, S, T]. Which one a node has is its rank, unknown before shape
inference, so the body holds both readings under an If on the rank; the If's condition folds once
the inputs are bound and the pass that inlines constant Ifs keeps the taken branch.
"""

from __future__ import annotations

import math

import onnx

from ir.errors import UnsupportedError
from ir.ops.contrib_transformer import DOMAIN, attr, function, number, present, signature, wanted
from ir.ops.registry import OTHER, register

MASK_FILTER_VALUE = -10000.0        # onnxruntime's default for mask_filter_value
FLOAT_LOWEST = -3.4028234663852886e38   # what the kernel adds for keys a causal mask hides


def _attention(node) -> onnx.FunctionProto:
    if present(node, 6) or attr(node, "past_present_share_buffer", 0):
        raise UnsupportedError(f"{node.describe()}: Attention with a shared past/present buffer "
                               "(past_sequence_length) is not supported")
    if attr(node, "do_rotary", 0):
        raise UnsupportedError(f"{node.describe()}: Attention with do_rotary is not supported")
    heads = int(node.attrs["num_heads"])
    q, k, v = _hidden_sizes(node)
    scale = float(attr(node, "scale", 0.0)) or 1.0 / math.sqrt(q // heads)
    lines = [f"heads_shape = Constant <value_ints = [0, 0, {heads}, -1]> ()",
             "axis0 = Constant <value_ints = [0]> ()", "axis1 = Constant <value_ints = [1]> ()"]
    for name, start, end in (("q", 0, q), ("k", q, q + k), ("v", q + k, q + k + v)):
        lines += [f"{name}_start = Constant <value_ints = [{start}]> ()",
                  f"{name}_end = Constant <value_ints = [{end}]> ()",
                  f"{name}_weight = Slice (weights, {name}_start, {name}_end, axis1)",
                  f"{name}_product = MatMul (input, {name}_weight)"]
        if present(node, 2):
            lines += [f"{name}_bias = Slice (bias, {name}_start, {name}_end, axis0)",
                      f"{name}_linear = Add ({name}_product, {name}_bias)"]
        else:
            lines.append(f"{name}_linear = Identity ({name}_product)")
        lines.append(f"{name}_heads = Reshape ({name}_linear, heads_shape)")
    lines.append("q_bnsh = Transpose <perm = [0, 2, 1, 3]> (q_heads)")
    lines += _keys_and_values(node)
    lines += ["raw = MatMul (q_bnsh, k_bnht)", f"scale = Constant <value_float = {number(scale)}> ()",
              "scores_0 = Mul (raw, scale)"]
    terms = []
    if present(node, 3) or attr(node, "unidirectional", 0):
        lines += _sizes_lines()
    if present(node, 5):
        terms.append("attention_bias")
    if present(node, 3):
        lines += _mask_lines(float(attr(node, "mask_filter_value", MASK_FILTER_VALUE)))
        terms.append("mask_add")
    if attr(node, "unidirectional", 0):
        lines += _causal_lines()
        terms.append("causal_add")
    for j, term in enumerate(terms):
        lines.append(f"scores_{j + 1} = Add (scores_{j}, {term})")
    lines += [f"probs = Softmax <axis = -1> (scores_{len(terms)})", "context = MatMul (probs, v_bnth)",
              "context_bsnh = Transpose <perm = [0, 2, 1, 3]> (context)",
              "joined_shape = Constant <value_ints = [0, 0, -1]> ()", "output = Reshape (context_bsnh, joined_shape)"]
    head = signature("Attention", ["input", "weights", "bias", "mask_index", "past", "attention_bias",
                                   "past_sequence_length"], node, ["output", "present"])
    return function(head + " {\n" + "\n".join(lines) + "\n}")


def _hidden_sizes(node) -> tuple[int, int, int]:
    sizes = attr(node, "qkv_hidden_sizes", None)
    if sizes:
        q, k, v = (int(s) for s in sizes)
    else:
        shape = node.inputs[1].shape
        if shape is None or len(shape) != 2 or not isinstance(shape[1], int):
            raise UnsupportedError(f"{node.describe()}: Attention needs qkv_hidden_sizes or a weight of known "
                                   "shape")
        q = k = v = shape[1] // 3
    heads = int(node.attrs["num_heads"])
    if q != k or q % heads or v % heads:
        raise UnsupportedError(f"{node.describe()}: Attention's hidden sizes {q, k, v} do not split into "
                               f"{heads} heads with equal Q and K sizes")
    return q, k, v


def _keys_and_values(node) -> list[str]:
    """k_bnht [B, N, H, T] and v_bnth [B, N, T, Hv], after the past ([2, B, N, P, H]) where given,
    and the present output (the past's keys and values, then these) where wanted."""
    if not present(node, 4) and not wanted(node, 1):
        return ["k_bnht = Transpose <perm = [0, 2, 3, 1]> (k_heads)",
                "v_bnth = Transpose <perm = [0, 2, 1, 3]> (v_heads)"]
    lines = ["k_new = Transpose <perm = [0, 2, 1, 3]> (k_heads)",
             "v_new = Transpose <perm = [0, 2, 1, 3]> (v_heads)"]
    if present(node, 4):
        lines += ["first = Constant <value_int = 0> ()", "second = Constant <value_int = 1> ()",
                  "past_k = Gather <axis = 0> (past, first)", "past_v = Gather <axis = 0> (past, second)",
                  "k_all = Concat <axis = 2> (past_k, k_new)", "v_bnth = Concat <axis = 2> (past_v, v_new)"]
    else:
        lines += ["k_all = Identity (k_new)", "v_bnth = Identity (v_new)"]
    lines.append("k_bnht = Transpose <perm = [0, 1, 3, 2]> (k_all)")
    if wanted(node, 1):
        lines += ["k_stacked = Unsqueeze (k_all, axis0)", "v_stacked = Unsqueeze (v_bnth, axis0)",
                  "present = Concat <axis = 0> (k_stacked, v_stacked)"]
    return lines


def _sizes_lines() -> list[str]:
    """S and T (query and key lengths) as 1-D and scalar int64, from the raw scores [B, N, S, T]."""
    return ["seq_1d = Shape <start = 2, end = 3> (raw)", "total_1d = Shape <start = 3> (raw)",
            "seq = Squeeze (seq_1d, axis0)", "total = Squeeze (total_1d, axis0)",
            "zero_i = Constant <value_int = 0> ()", "one_i = Constant <value_int = 1> ()",
            "zero_f = Constant <value_float = 0.0> ()"]


def _mask_lines(filter_value: float) -> list[str]:
    """mask_add [B, 1, 1 or S, T]: 0 where a key is attended, filter_value where it is masked."""
    return [f"filter = Constant <value_float = {number(filter_value)}> ()",
            "mask_shape = Shape (mask_index)", "mask_rank = Size (mask_shape)",
            "is_lengths = Equal (mask_rank, one_i)",
            f"mask_add = If (is_lengths) <then_branch = {_lengths_branch()}, else_branch = {_raw_branch()}>"]


def _lengths_branch() -> str:
    """[B] end positions, or [2B] ends then starts: padding the lengths with B zeros reads both forms
    with one body (a start of 0 masks nothing)."""
    return """lengths () => (float lengths_add) {
        batch = Shape <start = 0, end = 1> (input)
        no_starts = ConstantOfShape <value = int32[1] {0}> (batch)
        padded = Concat <axis = 0> (mask_index, no_starts)
        twice = Add (batch, batch)
        ends = Slice (padded, axis0, batch)
        starts = Slice (padded, batch, twice)
        ends_64 = Cast <to = 7> (ends)
        starts_64 = Cast <to = 7> (starts)
        ends_col = Unsqueeze (ends_64, axis1)
        starts_col = Unsqueeze (starts_64, axis1)
        positions = Range (zero_i, total, one_i)
        before_end = Less (positions, ends_col)
        after_start = GreaterOrEqual (positions, starts_col)
        attended = And (before_end, after_start)
        lengths_2d = Where (attended, zero_f, filter)
        middle = Constant <value_ints = [1, 2]> ()
        lengths_add = Unsqueeze (lengths_2d, middle)
    }"""


def _raw_branch() -> str:
    """A 0/1 mask [B, T] or [B, S, T]: any value above 0 attends."""
    return """raw_mask () => (float raw_add) {
        none = Constant <value = int32 {0}> ()
        keep = Greater (mask_index, none)
        raw_values = Where (keep, zero_f, filter)
        leading = Constant <value_ints = [0, 1, -1]> ()
        raw_shape = Concat <axis = 0> (leading, total_1d)
        raw_add = Reshape (raw_values, raw_shape)
    }"""


def _causal_lines() -> list[str]:
    """causal_add [S, T]: query i (after P = T - S past keys) sees keys 0..P+i."""
    return ["past_length = Sub (total, seq)", "rows = Range (zero_i, seq, one_i)",
            "limits = Add (rows, past_length)", "limits_col = Unsqueeze (limits, axis1)",
            "columns = Range (zero_i, total, one_i)", "visible = LessOrEqual (columns, limits_col)",
            f"hidden = Constant <value_float = {number(FLOAT_LOWEST)}> ()",
            "causal_add = Where (visible, zero_f, hidden)"]


register("Attention", domain=DOMAIN, kind=OTHER, expansion=_attention)
