"""The erf GELU as ONNX exporters write it, x * 0.5 * (1 + erf(x / sqrt 2)): a diamond of five
elementwise nodes that a GEMM or Conv kernel can run as its "gelu" epilogue (see `_fused_epilogue`
in `nn`) and that fusion groups keep whole (`passes.fuse_groups`)."""

import numpy as np

_SQRT2 = float(np.sqrt(2.0))


def erf_gelu_nodes(x, users: dict, graph_outputs: set[int]) -> list | None:
    """The five nodes computing x * 0.5 * (1 + erf(x / sqrt 2)) from `x` as exporters write it, the
    one producing the result last; None when the nodes reading `x` are not exactly that. x / sqrt 2
    may be a Div or a Mul by 1 / sqrt 2; the 0.5 may scale x, 1 + erf or the product; operands
    come in either order. Every intermediate value is read only inside the five, never a graph
    output, and all have x's shape (the constants are scalars)."""
    def readers(v):
        return [] if id(v) in graph_outputs else list({id(r): r for r in users.get(v, [])}.values())

    def sole(v):
        rs = readers(v)
        return rs[0] if len(rs) == 1 else None

    def binary(node, op, v):
        """The other operand when `node` is `op` with `v` as exactly one operand."""
        if node is None or node.op_type != op or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            return None
        a, c = node.inputs
        if (a is v) == (c is v) or tuple(node.outputs[0].shape) != tuple(x.shape):
            return None
        return c if a is v else a

    def scalar(v, target):
        return v is not None and v.is_const and np.asarray(v.const).size == 1 \
            and abs(float(np.asarray(v.const).reshape(-1)[0]) - target) <= 1e-6 * abs(target)

    def times(node, v, target):
        return scalar(binary(node, "Mul", v), target)

    first = readers(x)
    if len(first) != 2:
        return None
    for scale, side in (first, first[::-1]):
        if scalar(binary(scale, "Div", x), _SQRT2) and scale.inputs[0] is x or times(scale, x, 1 / _SQRT2):
            break
    else:
        return None
    erf = sole(scale.outputs[0])
    if erf is None or erf.op_type != "Erf" or erf.inputs[0] is not scale.outputs[0]:
        return None
    plus = sole(erf.outputs[0])
    if not scalar(binary(plus, "Add", erf.outputs[0]), 1.0):
        return None
    one_plus = plus.outputs[0]
    if times(side, x, 0.5):                                    # (x * 0.5) * (1 + erf)
        last = sole(side.outputs[0])
        found = [scale, erf, plus, side, last] if binary(last, "Mul", side.outputs[0]) is one_plus \
            and sole(one_plus) is last else None
    elif binary(side, "Mul", x) is one_plus and sole(one_plus) is side:   # (x * (1 + erf)) * 0.5
        last = sole(side.outputs[0])
        found = [scale, erf, plus, side, last] if times(last, side.outputs[0], 0.5) else None
    else:                                                      # x * ((1 + erf) * 0.5)
        half = sole(one_plus)
        found = [scale, erf, plus, half, side] if times(half, one_plus, 0.5) \
            and binary(side, "Mul", x) is half.outputs[0] and sole(half.outputs[0]) is side else None
    return found
