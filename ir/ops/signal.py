"""Signal-processing generators: the window functions and the mel filter bank.

Their parameters (a window's size, the mel matrix's bin counts and edges) are scalar inputs. Once
the output's shape is static (inferred from constant parameters, or declared by the model), the
values themselves are read at run time like any input, so a model that feeds them still compiles.
"""

import math

from ir.loops.expr import cast, eq, gt, logical_and, lt, select, unary
from ir.ops.registry import OTHER, lowering, register

register("BlackmanWindow", "HannWindow", "HammingWindow", "MelWeightMatrix", kind=OTHER)

# The cosine-sum coefficients (a0, a1, a2) of w[n] = a0 - a1 cos(2 pi n / N) + a2 cos(4 pi n / N),
# as the ops' ONNX function bodies define them (float32 constants).
_WINDOWS = {
    "HannWindow": (0.5, 0.5, 0.0),
    "HammingWindow": (25.0 / 46.0, 21.0 / 46.0, 0.0),
    "BlackmanWindow": (0.42, 0.5, 0.08),
}
# 2 pi rounded to float32, the function bodies' Tau.
_TAU_F32 = 6.2831854820251465


def scalar_input(b, node, i: int, type: str):
    """Input `i`'s single value: a Python number when constant, else a run-time load."""
    value = node.inputs[i]
    if value.is_const:
        return float(value.const.reshape(-1)[0]) if type in ("f32", "f64") else int(value.const.reshape(-1)[0])
    return cast(b.input(node, i).at(0), type)


@lowering("loops", *_WINDOWS)
def _window(b, node):
    """In float32 and in the function body's order: the angular step 2 pi / N first, then n times it."""
    a0, a1, a2 = _WINDOWS[node.op_type]
    y = b.output(node)
    size = scalar_input(b, node, 0, "f32")
    periodic = bool(node.attrs.get("periodic", 1))
    denominator = size if periodic else size - 1.0
    step = b.local("f32", _TAU_F32 / denominator, "step")
    with b.loop(y.numel, "n") as n:
        angle = cast(n, "f32") * step
        value = a0 - a1 * unary("cos", angle)
        if a2:
            value = value + a2 * unary("cos", angle * 2.0)
        b.store_flat(y, n, value)


@lowering("loops", "MelWeightMatrix")
def _mel_weight_matrix(b, node):
    """Triangular filters between mel-spaced frequency bins, as onnx's reference computes them (in
    float64): bin k of num_mel_bins + 2 edges sits at spectrogram row
    floor((dft_length + 1) * hz(mel_low + k * mel_step) / sample_rate); filter i rises from edge i
    to edge i + 1 and falls to edge i + 2."""
    y = b.output(node)
    rows, mels = y.shape
    mel_bins = scalar_input(b, node, 0, "f64")
    dft_length = scalar_input(b, node, 1, "f64")
    sample_rate = scalar_input(b, node, 2, "f64")
    low_mel = b.local("f64", _hz_to_mel(scalar_input(b, node, 3, "f64")), "low_mel")
    high_mel = b.local("f64", _hz_to_mel(scalar_input(b, node, 4, "f64")), "high_mel")
    mel_step = b.local("f64", (high_mel - low_mel) / (mel_bins + 2.0), "mel_step")

    def edge(k):
        hz = 700.0 * (unary("exp", (cast(k, "f64") * mel_step + low_mel) / 2595.0 * math.log(10.0)) - 1.0)
        return cast(unary("floor", (dft_length + 1.0) * hz / sample_rate), "i64")
    with b.loop(mels, "m") as m:
        left = b.local("i64", edge(m), "left")
        center = b.local("i64", edge(m + 1), "center")
        right = b.local("i64", edge(m + 2), "right")
        with b.loop(rows, "j") as j:
            row = cast(j, "i64")
            rising = cast(row - left, "f64") / cast(center - left, "f64")
            falling = cast(right - row, "f64") / cast(right - center, "f64")
            value = select(eq(row, center), 1.0,
                           select(logical_and(gt(row, left), lt(row, center)), rising,
                                  select(logical_and(gt(row, center), lt(row, right)), falling, 0.0)))
            b.store(y, (j, m), value)


def _hz_to_mel(hz):
    return 2595.0 * unary("log", 1.0 + hz / 700.0) / math.log(10.0) if not isinstance(hz, float) else \
        2595.0 * math.log1p(hz / 700.0) / math.log(10.0)
