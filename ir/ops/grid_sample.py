"""GridSample: each output position reads the input at a coordinate taken from the grid, by
nearest, linear or cubic interpolation, with zeros, border or reflection padding (2-D and 3-D).

The interpolation is separable: per spatial axis a coordinate, a first tap and tap weights, then
loops over the taps multiply the weights and read the input (after the padding rule of each axis),
as the ONNX reference does axis by axis.
"""

from ir.errors import UnsupportedError
from ir.loops.expr import all_of, cast, eq, gt, in_range, lt, maximum, minimum, select, unary
from ir.ops.registry import OTHER, lowering, register

register("GridSample", kind=OTHER)

_CUBIC_A = -0.75
_MODES = {"bilinear": "linear", "bicubic": "cubic"}     # opset 16 spellings


def _reflect(x, low: float, high: float):
    """Fold x into [low, high] by repeated reflection at the borders (float expression)."""
    span = high - low

    def folds(distance):
        """(an even number of reflections?, the remainder past the last one)"""
        n = unary("trunc", distance / span)
        return eq(n - 2.0 * unary("floor", n * 0.5), 0.0), distance - n * span
    even_below, rest_below = folds(low - x)
    even_above, rest_above = folds(x - high)
    below = select(even_below, low + rest_below, high - rest_below)
    above = select(even_above, high - rest_above, low + rest_above)
    return select(lt(x, low), below, select(gt(x, high), above, x))


def _cubic_weight(t, tap):
    """Keys' cubic convolution weight of tap 0..3 for the fractional offset t."""
    a = _CUBIC_A
    w = [((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
         ((a + 2) * t - (a + 3)) * t * t + 1,
         ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
         ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a]
    return select(eq(tap, 0), w[0], select(eq(tap, 1), w[1], select(eq(tap, 2), w[2], w[3])))


@lowering("loops", "GridSample")
def _grid_sample(b, node):
    x, grid, y = b.input(node, 0), b.input(node, 1), b.output(node)
    mode = node.attrs.get("mode", "linear")
    mode = _MODES.get(mode, mode)
    padding = node.attrs.get("padding_mode", "zeros")
    align = bool(node.attrs.get("align_corners", 0))
    dims = x.shape[2:]
    rank = len(dims)
    if mode not in ("nearest", "linear", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise UnsupportedError(f"{node.describe()}: GridSample mode {mode!r} / padding {padding!r}")
    taps = {"nearest": 1, "linear": 2, "cubic": 4}[mode]
    t = "f64" if x.compute_type == "f64" else "f32"
    with b.loops(y.shape, "o") as (n, c, *out):
        coords = []
        for i, size in enumerate(dims):
            g = cast(grid[(n, *out, rank - 1 - i)], t)
            low, high = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
            v = (g + 1.0) * 0.5 * (size - 1.0) if align else ((g + 1.0) * size - 1.0) * 0.5
            if mode == "nearest":
                v = unary("nearest", v)
            if padding == "border":
                v = select(lt(v, low), maximum(minimum(v, size - 1.0), 0.0),
                           select(gt(v, high), maximum(minimum(v, size - 1.0), 0.0), v))
            elif padding == "reflection":
                v = _reflect(v, low, high)
            v = b.local(t, v, "coord")
            first = b.local("i32", cast(unary("floor", v), "i32") - (1 if mode == "cubic" else 0), "first")
            coords.append((v, first, size, low, high))
        acc = b.local(t, 0.0, "acc")
        with b.loops([taps] * rank, "t") as tap:
            weight, valid, at = None, [], []
            for (v, first, size, low, high), k in zip(coords, tap):
                i = first + k
                if mode == "linear":
                    frac = v - cast(first, t)
                    w = select(eq(k, 0), 1.0 - frac, frac)
                elif mode == "cubic":
                    w = _cubic_weight(v - cast(first + 1, t), k)
                else:
                    w = None
                if padding == "zeros":
                    valid.append(in_range(i, size))
                    i = minimum(maximum(i, 0), size - 1)
                elif padding == "border":
                    i = minimum(maximum(i, 0), size - 1)
                else:
                    i = cast(_reflect(cast(i, t), low, high), "i32")
                at.append(i)
                weight = w if weight is None else (weight * w if w is not None else weight)
            value = cast(x[(n, c, *at)], t)
            if valid:
                value = select(all_of(valid), value, 0.0)
            b.assign(acc, acc + (value * weight if weight is not None else value))
        b.store(y, (n, c, *out), acc)
