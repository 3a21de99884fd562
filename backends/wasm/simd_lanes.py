"""SIMD128 lane selection shared by the WAT renderers (the vectoriser and the hand-written kernels):
the byte lists of `i8x16.shuffle` that pick 32-bit lanes, and the load of four 4-byte elements a
constant stride apart as one v128."""

from __future__ import annotations

# i8x16.shuffle byte lanes picking elements 0, s, 2s, 3s out of v128.load(base) and
# v128.load(base + 3s - 3): those two loads cover exactly elements base .. base + 3s, so they never
# read past the last lane's element
_STRIDED_SHUFFLE = {2: (0, 2, 5, 7), 3: (0, 3, 4, 7)}


def shuffle_lanes(*lanes: int) -> str:
    """i8x16.shuffle byte indices that pick these 32-bit lanes (4..7: the second operand's)."""
    return " ".join(str(4 * lane + byte) for lane in lanes for byte in range(4))


def strided_load(address: str, stride: int, offset: int | None = None, itemsize: int = 4) -> str:
    """Four elements at `address` + `offset`, `stride` elements apart (stride >= 2), as one v128,
    reading only bytes of that span: two overlapping loads and a shuffle for strides 2 and 3, one
    load per lane beyond. `offset` None writes the first load without a memarg."""
    base = offset or 0
    first = "" if offset is None else f"offset={offset} "
    if stride in _STRIDED_SHUFFLE:
        return (f"(i8x16.shuffle {shuffle_lanes(*_STRIDED_SHUFFLE[stride])} (v128.load {first}{address})"
                f" (v128.load offset={base + (3 * stride - 3) * itemsize} {address}))")
    text = f"(v128.load32_zero {first}{address})"
    for lane in range(1, 4):
        text = f"(v128.load32_lane offset={base + lane * stride * itemsize} {lane} {address} {text})"
    return text
