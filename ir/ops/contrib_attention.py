"""onnxruntime's attention ops as function bodies over standard ops, expanded by the expand-ops pass
like the other contrib ops (`contrib_transformer`): Attention (packed QKV weight), MultiHeadAttention
(Q, K and V projected outside it; what the transformer optimizer writes with
`use_multi_head_attention`, and for cross attention), GroupQueryAttention (language models with a
key/value cache) and RotaryEmbedding.

Attention's body follows onnxruntime's CPU kernel (contrib_ops/cpu/bert/attention.cc and
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

from ir.errors import NeedsShapes, NotExpanded, UnsupportedError
from ir.ops.contrib_transformer import DOMAIN, attr, function, number, present, signature, wanted
from ir.ops.registry import OTHER, register

MASK_FILTER_VALUE = -10000.0        # onnxruntime's default for mask_filter_value
FLOAT_LOWEST = -3.4028234663852886e38   # what the kernel adds for keys a causal mask hides
INT64_MAX = 2 ** 63 - 1                 # a Slice end: to the end of the axis


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
    lines += _attend(node, mask=3, attention_bias=5, batch_of="input")
    head = signature("Attention", ["input", "weights", "bias", "mask_index", "past", "attention_bias",
                                   "past_sequence_length"], node, ["output", "present"])
    return function(head + " {\n" + "\n".join(lines) + "\n}")


def _attend(node, mask: int, attention_bias: int, batch_of: str) -> list[str]:
    """From the scaled scores `scores_0` [B, N, S, T] and `v_bnth`: the attention bias, the mask (the
    input at position `mask`, named `mask_index` in the body) and the causal mask added, softmax,
    times V, heads joined into `output` [B, S, N * Hv]. `batch_of` is a body value whose first axis
    is the batch."""
    lines, terms = [], []
    if present(node, mask) or attr(node, "unidirectional", 0):
        lines += _sizes_lines()
    if present(node, attention_bias):
        terms.append("attention_bias")
    if present(node, mask):
        lines += _mask_lines(float(attr(node, "mask_filter_value", MASK_FILTER_VALUE)), batch_of)
        terms.append("mask_add")
    if attr(node, "unidirectional", 0):
        lines += _causal_lines()
        terms.append("causal_add")
    for j, term in enumerate(terms):
        lines.append(f"scores_{j + 1} = Add (scores_{j}, {term})")
    return lines + [f"probs = Softmax <axis = -1> (scores_{len(terms)})", "context = MatMul (probs, v_bnth)",
                    "context_bsnh = Transpose <perm = [0, 2, 1, 3]> (context)",
                    "joined_shape = Constant <value_ints = [0, 0, -1]> ()",
                    "output = Reshape (context_bsnh, joined_shape)"]


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


def _mask_lines(filter_value: float, batch_of: str) -> list[str]:
    """mask_add [B, 1, 1 or S, T]: 0 where a key is attended, filter_value where it is masked."""
    return [f"filter = Constant <value_float = {number(filter_value)}> ()",
            "mask_shape = Shape (mask_index)", "mask_rank = Size (mask_shape)",
            "is_lengths = Equal (mask_rank, one_i)",
            f"mask_add = If (is_lengths) <then_branch = {_lengths_branch(batch_of)}, else_branch = {_raw_branch()}>"]


def _lengths_branch(batch_of: str) -> str:
    """[B] end positions, or [2B] ends then starts: padding the lengths with B zeros reads both forms
    with one body (a start of 0 masks nothing)."""
    return f"""lengths () => (float lengths_add) {{
        batch = Shape <start = 0, end = 1> ({batch_of})
        no_starts = ConstantOfShape <value = int32[1] {{0}}> (batch)
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
    }}"""


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


def _multi_head_attention(node) -> onnx.FunctionProto:
    """MultiHeadAttention as onnxruntime's CPU kernel runs it (contrib_ops/cpu/bert/multihead_attention.cc):
    Q [B, S, D], and either K and V [B, L, D] / [B, L, Dv] (projected, the bias's column blocks added,
    split into heads) or K and V already in heads [B, N, L, H] (a cross attention's cached keys and
    values, used as given); past keys and values [B, N, P, H] before them and the present outputs;
    then scores, masks and softmax as Attention's."""
    heads = int(node.attrs["num_heads"])
    if not present(node, 1) or not present(node, 2):
        raise NotExpanded(f"{node.describe()}: MultiHeadAttention with packed QKV or KV in one input is not "
                          "supported (onnxruntime's CPU kernel does not run it either)")
    if present(node, 8) or present(node, 9):
        raise NotExpanded(f"{node.describe()}: MultiHeadAttention with a shared past/present buffer or a "
                          "cache indirection (beam search) is not supported")
    if wanted(node, 3):
        raise NotExpanded(f"{node.describe()}: MultiHeadAttention's qk output is not supported")
    q_rank, k_rank = _rank(node, 0), _rank(node, 1)
    if q_rank != 3 or k_rank not in (3, 4) or _rank(node, 2) != k_rank:
        raise NotExpanded(f"{node.describe()}: MultiHeadAttention with query of rank {q_rank} and key of rank "
                          f"{k_rank} is not supported (query [B, S, D]; key and value [B, L, D] or [B, N, L, H])")
    if k_rank == 4 and present(node, 6):
        raise NotExpanded(f"{node.describe()}: MultiHeadAttention with keys in heads and a past is not supported")
    biased = present(node, 3)
    lines = [f"heads_shape = Constant <value_ints = [0, 0, {heads}, -1]> ()",
             "axis0 = Constant <value_ints = [0]> ()", "axis1 = Constant <value_ints = [1]> ()",
             "q_width = Shape <start = 2> (query)", "qk_width = Add (q_width, q_width)",
             f"all_of_it = Constant <value_ints = [{INT64_MAX}]> ()"]
    projected = [("q", "query", "axis0_start", "q_width")]
    if k_rank == 3:
        projected += [("k", "key", "q_width", "qk_width"), ("v", "value", "qk_width", "all_of_it")]
    lines.append("axis0_start = Constant <value_ints = [0]> ()")
    for name, source, start, end in projected:
        if biased:
            lines += [f"{name}_bias = Slice (bias, {start}, {end}, axis0)", f"{name}_linear = Add ({source}, {name}_bias)"]
        else:
            lines.append(f"{name}_linear = Identity ({source})")
        lines += [f"{name}_heads = Reshape ({name}_linear, heads_shape)",
                  f"{name}_new = Transpose <perm = [0, 2, 1, 3]> ({name}_heads)"]
    if k_rank == 4:
        lines += ["k_new = Identity (key)", "v_new = Identity (value)"]
    if present(node, 6):
        lines += ["k_all = Concat <axis = 2> (past_key, k_new)", "v_bnth = Concat <axis = 2> (past_value, v_new)"]
    else:
        lines += ["k_all = Identity (k_new)", "v_bnth = Identity (v_new)"]
    if wanted(node, 1):
        lines.append("present_key = Identity (k_all)")
    if wanted(node, 2):
        lines.append("present_value = Identity (v_bnth)")
    lines += ["k_bnht = Transpose <perm = [0, 1, 3, 2]> (k_all)", "raw = MatMul (q_new, k_bnht)"]
    lines += _scale_lines(node)
    lines.append("scores_0 = Mul (raw, scale)")
    lines += _attend(node, mask=4, attention_bias=5, batch_of="query")
    head = signature("MultiHeadAttention", ["query", "key", "value", "bias", "mask_index", "attention_bias",
                                            "past_key", "past_value", "past_sequence_length", "cache_indirection"],
                     node, ["output", "present_key", "present_value", "qk"])
    return function(head + " {\n" + "\n".join(lines) + "\n}")


def _scale_lines(node) -> list[str]:
    """`scale`: the node's scale attribute, or 1 / sqrt(head size) read off the heads of `q_new`."""
    scale = float(attr(node, "scale", 0.0))
    if scale:
        return [f"scale = Constant <value_float = {number(scale)}> ()"]
    return ["head_size = Shape <start = -1> (q_new)", "head_size_f = Cast <to = 1> (head_size)",
            "root = Sqrt (head_size_f)", "one_f = Constant <value_float = 1.0> ()", "scale = Div (one_f, root)"]


def _rank(node, index: int) -> int:
    shape = node.inputs[index].shape
    if shape is None:
        raise NeedsShapes(f"{node.describe()}: {node.op_type} needs the rank of input {index}")
    return len(shape)


def _rotary_embedding(node) -> onnx.FunctionProto:
    """onnxruntime's RotaryEmbedding (contrib_ops/cpu/bert/rotary_embedding.cc): each head's first
    `rotary_embedding_dim` features (all of them by default) rotated by the angle of its position,
    read from the cos and sin caches [max positions, rotary dim / 2]; the rest pass through.

        halves (x1, x2), or pairs (x[2i], x[2i+1]) when interleaved:  x1 cos - x2 sin,  x2 cos + x1 sin

    The input is [B, S, N * H] or [B, N, S, H]; positions are [B, S], or one offset p for all
    (positions p, p + 1, ...)."""
    if attr(node, "is_packed_batching", 0):
        raise NotExpanded(f"{node.describe()}: RotaryEmbedding with packed batching is not supported")
    rank, positions_rank = _rank(node, 0), _rank(node, 1)
    cache = node.inputs[2].shape
    if cache is None or len(cache) != 2 or not isinstance(cache[1], int):
        raise NeedsShapes(f"{node.describe()}: RotaryEmbedding needs the shape of its cos cache")
    heads, rotary = int(attr(node, "num_heads", 0)), int(attr(node, "rotary_embedding_dim", 0))
    rotary = rotary or 2 * cache[1]
    half = rotary // 2
    if half != cache[1]:
        raise NotExpanded(f"{node.describe()}: RotaryEmbedding with a cache of {cache[1]} columns for a "
                          f"rotary dimension of {rotary} is not supported")
    seq_axis, cos_axis = (1, 2) if rank == 3 else (2, 1)     # the heads axis the angles broadcast over
    lines = ["axis0 = Constant <value_ints = [0]> ()"]
    if rank == 3:       # [B, S, N * H] -> [B, S, N, H]
        shape = f"[0, 0, {heads}, -1]" if heads else f"[0, 0, -1, {rotary}]"
        if heads == 0 and attr(node, "rotary_embedding_dim", 0):
            raise NotExpanded(f"{node.describe()}: RotaryEmbedding with rotary_embedding_dim needs num_heads")
        lines += [f"heads_shape = Constant <value_ints = {shape}> ()", "x = Reshape (input, heads_shape)"]
    elif rank == 4:
        lines.append("x = Identity (input)")
    else:
        raise NotExpanded(f"{node.describe()}: RotaryEmbedding of a rank-{rank} input is not supported")
    if positions_rank == 2:
        lines.append("positions = Identity (position_ids)")
    else:               # one offset: positions offset + 0 .. S - 1, for every batch
        lines += [f"seq_1d = Shape <start = {seq_axis}, end = {seq_axis + 1}> (input)",
                  "seq = Squeeze (seq_1d, axis0)", "zero_i = Constant <value_int = 0> ()",
                  "one_i = Constant <value_int = 1> ()", "steps = Range (zero_i, seq, one_i)",
                  "one_by_one = Constant <value_ints = [1, 1]> ()", "offset = Reshape (position_ids, one_by_one)",
                  "steps_row = Unsqueeze (steps, axis0)", "positions = Add (offset, steps_row)"]
    lines += _rotation_lines("x", "y", "positions", cos_axis, rotary, bool(attr(node, "interleaved", 0)))
    if rank == 3:
        lines += ["joined_shape = Constant <value_ints = [0, 0, -1]> ()", "output = Reshape (y, joined_shape)"]
    else:
        lines.append("output = Identity (y)")
    head = signature("RotaryEmbedding", ["input", "position_ids", "cos_cache", "sin_cache"], node, ["output"])
    return function(head + " {\n" + "\n".join(lines) + "\n}")


def _group_query_attention(node) -> onnx.FunctionProto:
    """onnxruntime's GroupQueryAttention (contrib_ops/cpu/bert/gqa_attention_base.h), the attention of
    language models exported with a key/value cache: N query heads over N_kv key/value heads (query
    head n reads head n // (N / N_kv)), causal, over the past [B, N_kv, P, H] and this step's keys.

    Per batch entry b the cache holds t_b = seqlens_k[b] + 1 positions after this step, and this
    step's S tokens start at p_b = max(t_b - S, 0) (0 in a first prompt, where t_b <= S): the
    present cache [B, N_kv, T, H], T = max(total_sequence_length, P), is the past's first p_b rows,
    then the S new ones, then zeros, as the kernel writes it. Query s attends keys 0 .. p_b + s (the
    last local_window_size of them with a local window, as onnxruntime 1.32 computes it, measured:
    earlier kernels kept one more); rotary embeddings (do_rotary) rotate Q
    and K at positions p_b + s first, and softcap bounds the scaled scores (softcap * tanh(x / softcap))."""
    heads, kv_heads = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
    unsupported = [what for what, used in (
        ("a quantized cache", present(node, 12) or present(node, 13) or attr(node, "kv_cache_bit_width", 0)),
        ("a sliding window cache", attr(node, "sliding_window_cache", 0)),
        ("query_seqlens", present(node, 16)), ("Q/K norms", present(node, 14) or present(node, 15)),
        ("position_ids", present(node, 9)), ("attention_bias", present(node, 10)),
        ("head_sink", present(node, 11)), ("smooth_softmax", attr(node, "smooth_softmax", 0)),
        ("the QK output", wanted(node, 3) or attr(node, "qk_output", 0)),
        ("causal=0", not attr(node, "causal", 1))) if used]
    if unsupported:
        raise NotExpanded(f"{node.describe()}: GroupQueryAttention with {', '.join(unsupported)} is not supported")
    if heads % kv_heads:
        raise NotExpanded(f"{node.describe()}: GroupQueryAttention with {heads} query heads over {kv_heads} "
                          "key/value heads is not supported")
    group = heads // kv_heads
    lines = ["axis0 = Constant <value_ints = [0]> ()", "axis1 = Constant <value_ints = [1]> ()",
             "zero_i = Constant <value_int = 0> ()", "one_i = Constant <value_int = 1> ()",
             "zero_f = Constant <value_float = 0.0> ()"]
    if present(node, 1):
        lines += [f"q_shape = Constant <value_ints = [0, 0, {heads}, -1]> ()",
                  f"kv_shape = Constant <value_ints = [0, 0, {kv_heads}, -1]> ()",
                  "q_bsnh = Reshape (query, q_shape)", "k_bsnh = Reshape (key, kv_shape)",
                  "v_bsnh = Reshape (value, kv_shape)"]
    else:               # packed: [B, S, (N + 2 N_kv) H]
        lines += [f"qkv_shape = Constant <value_ints = [0, 0, {heads + 2 * kv_heads}, -1]> ()",
                  "qkv = Reshape (query, qkv_shape)", "axis2 = Constant <value_ints = [2]> ()",
                  f"q_end = Constant <value_ints = [{heads}]> ()", f"k_end = Constant <value_ints = [{heads + kv_heads}]> ()",
                  f"v_end = Constant <value_ints = [{heads + 2 * kv_heads}]> ()",
                  "q_bsnh = Slice (qkv, axis0, q_end, axis2)", "k_bsnh = Slice (qkv, q_end, k_end, axis2)",
                  "v_bsnh = Slice (qkv, k_end, v_end, axis2)"]
    lines += ["q_in = Transpose <perm = [0, 2, 1, 3]> (q_bsnh)", "k_in = Transpose <perm = [0, 2, 1, 3]> (k_bsnh)",
              "v_new = Transpose <perm = [0, 2, 1, 3]> (v_bsnh)",
              # S, t_b and p_b
              "seq_1d = Shape <start = 2, end = 3> (q_in)", "seq = Squeeze (seq_1d, axis0)",
              "lengths_64 = Cast <to = 7> (seqlens_k)", "one_1d = Constant <value_ints = [1]> ()",
              "totals = Add (lengths_64, one_1d)", "starts_signed = Sub (totals, seq_1d)",
              "zero_1d = Constant <value_ints = [0]> ()", "starts = Max (starts_signed, zero_1d)",
              "steps = Range (zero_i, seq, one_i)", "starts_col = Unsqueeze (starts, axis1)",
              "steps_row = Unsqueeze (steps, axis0)", "positions = Add (starts_col, steps_row)"]
    if attr(node, "do_rotary", 0):
        cache = node.inputs[7].shape if present(node, 7) else None
        if cache is None or len(cache) != 2 or not isinstance(cache[1], int):
            raise NeedsShapes(f"{node.describe()}: GroupQueryAttention needs the shape of its cos cache")
        interleaved = bool(attr(node, "rotary_interleaved", 0))
        lines += _rotation_lines("q_in", "q_new", "positions", 1, 2 * cache[1], interleaved, "rq")
        lines += _rotation_lines("k_in", "k_new", "positions", 1, 2 * cache[1], interleaved, "rk")
    else:
        lines += ["q_new = Identity (q_in)", "k_new = Identity (k_in)"]
    if present(node, 3):
        lines += ["past_1d = Shape <start = 2, end = 3> (past_key)", "k_past = Identity (past_key)",
                  "v_past = Identity (past_value)"]
    else:
        lines += ["past_1d = Constant <value_ints = [0]> ()", "rows_axis = Constant <value_ints = [2]> ()",
                  "k_past = Slice (k_new, past_1d, past_1d, rows_axis)",
                  "v_past = Slice (v_new, past_1d, past_1d, rows_axis)"]
    lines += [# the present cache: row j of batch b from the past (j < p_b), the new row j - p_b, or 0;
              # the new rows placed by a one-hot product and the past padded to T, not gathered
              # row by row from a concatenation: a decode step then costs one pass over the cache
              "total_64 = Cast <to = 7> (total_sequence_length)", "total_1d = Reshape (total_64, one_1d)",
              "present_1d = Max (total_1d, past_1d)", "present_len = Squeeze (present_1d, axis0)",
              "rows = Range (zero_i, present_len, one_i)", "rows_row = Unsqueeze (rows, axis0)",
              "from_past = Less (rows_row, starts_col)", "offset = Sub (rows_row, starts_col)",
              "two_1d = Constant <value_ints = [2]> ()",
              "last_axis = Constant <value_ints = [2]> ()", "first_two = Constant <value_ints = [0, 1]> ()",
              "offset_3d = Unsqueeze (offset, last_axis)", "steps_3d = Unsqueeze (steps, first_two)",
              "is_step = Equal (offset_3d, steps_3d)", "one_hot = Cast <to = 1> (is_step)",
              "one_hot_heads = Unsqueeze (one_hot, axis1)",
              "k_placed = MatMul (one_hot_heads, k_new)", "v_placed = MatMul (one_hot_heads, v_new)",
              "grown_1d = Sub (present_1d, past_1d)", "new_shape = Shape (k_new)",
              "new_lead = Slice (new_shape, zero_1d, two_1d, axis0)", "head_size_1d = Shape <start = 3> (k_new)",
              "grown_shape = Concat <axis = 0> (new_lead, grown_1d, head_size_1d)",
              "grown_zeros = Expand (zero_f, grown_shape)",
              "k_past_fit = Concat <axis = 2> (k_past, grown_zeros)", "v_past_fit = Concat <axis = 2> (v_past, grown_zeros)",
              "outer = Constant <value_ints = [1, 3]> ()", "from_past_4d = Unsqueeze (from_past, outer)",
              "present_key = Where (from_past_4d, k_past_fit, k_placed)",
              "present_value = Where (from_past_4d, v_past_fit, v_placed)",
              "lead = Shape <end = 1> (k_new)",
              # scores by key/value head: [B, N_kv, G, S, T]
              f"groups = Constant <value_ints = [{kv_heads}, {group}]> ()",
              "q_tail = Shape <start = 2> (q_new)", "q_groups_shape = Concat <axis = 0> (lead, groups, q_tail)",
              "q_groups = Reshape (q_new, q_groups_shape)", "axis2_only = Constant <value_ints = [2]> ()",
              "k_groups = Unsqueeze (present_key, axis2_only)", "v_groups = Unsqueeze (present_value, axis2_only)",
              "k_t = Transpose <perm = [0, 1, 2, 4, 3]> (k_groups)", "raw = MatMul (q_groups, k_t)"]
    lines += _scale_lines(node)
    lines.append("scaled = Mul (raw, scale)")
    softcap = float(attr(node, "softcap", 0.0))
    if softcap > 0:
        lines += [f"softcap = Constant <value_float = {number(softcap)}> ()", "capped_in = Div (scaled, softcap)",
                  "capped_tanh = Tanh (capped_in)", "scores = Mul (capped_tanh, softcap)"]
    else:
        lines.append("scores = Identity (scaled)")
    # query s of batch b (at position p_b + s) sees keys 0 .. p_b + s, the last `window` of them
    lines += ["rows_3d = Unsqueeze (rows_row, axis0)", "end_axis = Constant <value_ints = [2]> ()",
              "limits = Unsqueeze (positions, end_axis)", "visible_causal = LessOrEqual (rows_3d, limits)"]
    window = int(attr(node, "local_window_size", -1))
    if window > 0:
        lines += [f"window = Constant <value_ints = [{window - 1}]> ()", "window_start = Sub (limits, window)",
                  "in_window = GreaterOrEqual (rows_3d, window_start)", "visible = And (visible_causal, in_window)"]
    else:
        lines.append("visible = Identity (visible_causal)")
    lines += ["middle = Constant <value_ints = [1, 2]> ()", "visible_5d = Unsqueeze (visible, middle)",
              f"hidden_score = Constant <value_float = {number(FLOAT_LOWEST)}> ()",
              "masked = Where (visible_5d, scores, hidden_score)", "probs = Softmax <axis = -1> (masked)",
              "context = MatMul (probs, v_groups)", "heads_shape = Shape (q_new)",
              "context_bnsh = Reshape (context, heads_shape)", "context_bsnh = Transpose <perm = [0, 2, 1, 3]> (context_bnsh)",
              "joined_shape = Constant <value_ints = [0, 0, -1]> ()", "output = Reshape (context_bsnh, joined_shape)"]
    head = signature("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value", "seqlens_k",
                                             "total_sequence_length", "cos_cache", "sin_cache", "position_ids",
                                             "attention_bias", "head_sink", "k_scale", "v_scale", "q_norm_weight",
                                             "k_norm_weight", "query_seqlens"],
                     node, ["output", "present_key", "present_value", "output_qk"])
    return function(head + " {\n" + "\n".join(lines) + "\n}")


def _rotation_lines(x: str, y: str, positions: str, heads_axis: int, rotary: int, interleaved: bool,
                    p: str = "r") -> list[str]:
    """`y` = `x` (rank 4, heads along `heads_axis`, features last) with its first `rotary` features
    of each head rotated by the angles of `positions` ([B or 1, S], int64) read from the body's
    `cos_cache` and `sin_cache`, as onnxruntime's RotaryEmbedding kernel does; `p` prefixes the
    body values it makes."""
    half = rotary // 2
    lines = [f"{p}_last = Constant <value_ints = [-1]> ()", f"{p}_zero = Constant <value_ints = [0]> ()",
             f"{p}_half = Constant <value_ints = [{half}]> ()", f"{p}_rotary = Constant <value_ints = [{rotary}]> ()",
             f"{p}_all = Constant <value_ints = [{INT64_MAX}]> ()",
             f"{p}_cos_rows = Gather <axis = 0> (cos_cache, {positions})",
             f"{p}_sin_rows = Gather <axis = 0> (sin_cache, {positions})",
             f"{p}_heads_axis = Constant <value_ints = [{heads_axis}]> ()",
             f"{p}_cos = Unsqueeze ({p}_cos_rows, {p}_heads_axis)", f"{p}_sin = Unsqueeze ({p}_sin_rows, {p}_heads_axis)",
             f"{p}_x = Slice ({x}, {p}_zero, {p}_rotary, {p}_last)"]
    cos, sin = f"{p}_cos", f"{p}_sin"
    if interleaved:
        lines += [f"{p}_pairs_shape = Constant <value_ints = [0, 0, 0, {half}, 2]> ()",
                  f"{p}_pairs = Reshape ({p}_x, {p}_pairs_shape)", f"{p}_one = Constant <value_ints = [1]> ()",
                  f"{p}_two = Constant <value_ints = [2]> ()",
                  f"{p}_x1 = Slice ({p}_pairs, {p}_zero, {p}_one, {p}_last)",
                  f"{p}_x2 = Slice ({p}_pairs, {p}_one, {p}_two, {p}_last)",
                  f"{p}_cos_p = Unsqueeze ({cos}, {p}_last)", f"{p}_sin_p = Unsqueeze ({sin}, {p}_last)"]
        cos, sin = f"{p}_cos_p", f"{p}_sin_p"
    else:
        lines += [f"{p}_x1 = Slice ({p}_x, {p}_zero, {p}_half, {p}_last)",
                  f"{p}_x2 = Slice ({p}_x, {p}_half, {p}_rotary, {p}_last)"]
    lines += [f"{p}_x1_cos = Mul ({p}_x1, {cos})", f"{p}_x2_sin = Mul ({p}_x2, {sin})",
              f"{p}_y1 = Sub ({p}_x1_cos, {p}_x2_sin)", f"{p}_x2_cos = Mul ({p}_x2, {cos})",
              f"{p}_x1_sin = Mul ({p}_x1, {sin})", f"{p}_y2 = Add ({p}_x2_cos, {p}_x1_sin)",
              f"{p}_parts = Concat <axis = -1> ({p}_y1, {p}_y2)"]
    if interleaved:
        lines += [f"{p}_rot_shape = Constant <value_ints = [0, 0, 0, {rotary}]> ()",
                  f"{p}_y = Reshape ({p}_parts, {p}_rot_shape)"]
    else:
        lines.append(f"{p}_y = Identity ({p}_parts)")
    return lines + [f"{p}_pass = Slice ({x}, {p}_rotary, {p}_all, {p}_last)", f"{y} = Concat <axis = -1> ({p}_y, {p}_pass)"]


register("Attention", domain=DOMAIN, kind=OTHER, expansion=_attention)
register("MultiHeadAttention", domain=DOMAIN, kind=OTHER, expansion=_multi_head_attention)
register("RotaryEmbedding", domain=DOMAIN, kind=OTHER, expansion=_rotary_embedding)
register("GroupQueryAttention", domain=DOMAIN, kind=OTHER, expansion=_group_query_attention)
