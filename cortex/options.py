"""Parsing of the option strings users type: `--input-shape x=1x3x224x224`, `--dim batch=1`."""

from __future__ import annotations

import re

from ir.errors import CortexError

_SHAPE = re.compile(r"^\s*([^=\s]+)\s*=\s*(\d+(?:\s*[x,]\s*\d+)*|scalar)\s*$")
_DIM = re.compile(r"^\s*([^=\s]+)\s*=\s*(\d+)\s*$")


def parse_input_shapes(items: list[str] | None) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items or []:
        m = _SHAPE.match(item)
        if not m:
            raise CortexError(f"bad --input-shape {item!r}: expected NAME=D1xD2x... with integers, "
                              "e.g. input=1x3x224x224 (or NAME=scalar)")
        name, dims = m.group(1), m.group(2)
        shape = () if dims == "scalar" else tuple(int(d) for d in re.split(r"\s*[x,]\s*", dims))
        # a 0 is an empty dim, as in onnxruntime: a decoder's first step has an empty past
        if name in shapes:
            raise CortexError(f"--input-shape given twice for {name!r}")
        shapes[name] = shape
    return shapes


def parse_dims(items: list[str] | None) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in items or []:
        m = _DIM.match(item)
        if not m:
            raise CortexError(f"bad --dim {item!r}: expected NAME=N with an integer, e.g. batch=1 (0: empty)")
        dims[m.group(1)] = int(m.group(2))
    return dims
