"""Sliding-window geometry shared by the Conv and pooling lowerings: strides, dilations, padding
(explicit or `auto_pad`), the padded input extent `ceil_mode` may need, and average-pool divisors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class WindowGeometry:
    strides: list[int]
    dilations: list[int]
    pads_begin: list[int]
    pads_end: list[int]          # as the model gives them (before any ceil_mode extension)
    padded: list[int]            # the extent of the padded input the loops read


def window_geometry(node, spatial, kernel, out_spatial) -> WindowGeometry:
    rank = len(spatial)
    strides = [int(s) for s in node.attrs.get("strides", [1] * rank)]
    dilations = [int(d) for d in node.attrs.get("dilations", [1] * rank)]
    pads = [int(p) for p in node.attrs.get("pads", [0] * (2 * rank))]
    begin, end = pads[:rank], pads[rank:]
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for n, k, s, d, o in zip(spatial, kernel, strides, dilations, out_spatial):
            total = max(0, (o - 1) * s + (k - 1) * d + 1 - n)
            small = total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
    elif auto_pad == "VALID":
        begin, end = [0] * rank, [0] * rank
    padded = [max(b + n + e, (o - 1) * s + (k - 1) * d + 1)
              for n, k, s, d, o, b, e in zip(spatial, kernel, strides, dilations, out_spatial, begin, end)]
    return WindowGeometry(strides, dilations, begin, end, padded)


def pad_buffer(b, x, pads_begin, padded, value):
    """`x` (N, C, *spatial) placed in a `value`-filled buffer of spatial extent `padded`, so window
    loops read without bounds checks; `x` itself when no padding is needed."""
    spatial = x.shape[2:]
    if not any(pads_begin) and list(padded) == list(spatial):
        return x
    xp = b.temp(x.dtype, (*x.shape[:2], *padded), x.name + "_padded")
    b.fill(xp, value)
    with b.loops(x.shape) as (n, c, *i):
        b.store(xp, (n, c, *[v + p for v, p in zip(i, pads_begin)]), x[(n, c, *i)])
    return xp


def pool_divisors(geo: WindowGeometry, spatial, out_spatial, kernel, count_include_pad: bool) -> np.ndarray:
    """1 / (number of window positions averaged) for every output position. With
    count_include_pad the explicit padding counts, but never the extension ceil_mode adds."""
    per_dim = []
    for n, o_n, k, s, d, pb, pe in zip(spatial, out_spatial, kernel, geo.strides, geo.dilations,
                                       geo.pads_begin, geo.pads_end):
        pos = np.arange(o_n)[:, None] * s - pb + np.arange(k)[None, :] * d
        low, high = (-pb, n + pe) if count_include_pad else (0, n)
        per_dim.append(((pos >= low) & (pos < high)).sum(axis=1))
    counts = per_dim[0].astype(np.float64)
    for c in per_dim[1:]:
        counts = np.multiply.outer(counts, c)
    return (1.0 / np.maximum(counts, 1)).astype(np.float32)
