"""A request's input checked against the dag's spec of it, in the words every runtime uses."""

from __future__ import annotations

import numpy as np

from ir.errors import CortexError


def checked_input(name: str, spec: dict, feeds: dict) -> np.ndarray:
    """`feeds[name]` as an array of the dtype and shape `spec` gives; anything else is one error."""
    if name not in feeds:
        raise CortexError(f"missing input {name!r} ({spec['dtype']}{spec['shape']})")
    value = np.asarray(feeds[name])
    if value.dtype != np.dtype(spec["dtype"]):
        raise CortexError(f"input {name!r} has dtype {value.dtype}, the model expects {spec['dtype']}")
    if list(value.shape) != list(spec["shape"]):
        raise CortexError(f"input {name!r} has shape {list(value.shape)}, the model expects {spec['shape']}")
    return value
