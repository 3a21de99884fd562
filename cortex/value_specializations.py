"""Value specializations: one model built for several values of one input (`--specialize sr=8000,16000`).

A model whose If is decided by an input (a voice-activity model taking its 8 kHz or its 16 kHz
branch from `sr`) has branches of different shapes, so no one static build holds both, and freezing
the input (`--freeze-input`) holds one. A value specialization is a section built as if the input
were frozen to that value (passes/freeze_inputs.py: the If's condition becomes a constant and the If
its branch), one per value, all in one cortex.dag/2 bundle with the shape specializations
(cortex/specializations.py; both together build every combination). The input stays an input for
the caller: a section records its shape in `input_shapes`, its value in `input_values`, and its dtype
in the frozen inputs its build records; the runtimes pick a request's section by the value it gives.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from ir import dtypes
from ir.errors import CortexError
from ir.graph import Graph, Value

_ITEM = re.compile(r"^\s*([^=\s]+)\s*(?:=(.*))?$")
_INTEGER = re.compile(r"^[+-]?\d+$")
_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}
# Ops between an input and the Equal that compares it, or between that Equal and the If it decides,
# that keep the compared value: the TorchScript exporter writes Equal -> Cast(bool) -> If.
_KEEPS_VALUE = ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten", "Not")


def parse_specialize(items: list[str]) -> dict[str, list[str] | None]:
    """--specialize NAME=V1,V2 (repeatable, one input each), or NAME alone: None, the values the
    model compares the input against (`compared_values`)."""
    found: dict[str, list[str] | None] = {}
    for item in items:
        m = _ITEM.match(item)
        texts = None if not m or m.group(2) is None else [t.strip() for t in m.group(2).split(",")]
        if not m or (texts is not None and not all(texts)):
            raise CortexError(f"bad --specialize {item!r}: expected NAME=V1,V2,... with one value per "
                              "specialization, e.g. sr=8000,16000 (or NAME alone: the values the model's If "
                              "compares it against)")
        if m.group(1) in found:
            raise CortexError(f"--specialize {m.group(1)} is given twice; list its values once: "
                              f"{m.group(1)}=V1,V2,...")
        found[m.group(1)] = texts
    return found


def value_rows(parsed: dict[str, list[str] | None], graph: Graph,
               input_shapes: dict[str, tuple[int, ...]]) -> list[dict[str, np.ndarray]]:
    """Every combination of the inputs' values, each value an array of its input's dtype and
    shape (`input_shapes` binds an input of dynamic shape)."""
    by_name = {v.name: v for v in graph.inputs}
    columns = []
    for name, texts in parsed.items():
        value = by_name.get(name)
        if value is None:
            raise CortexError(f"--specialize names {name!r}, which is not an input of the model "
                              f"(inputs: {', '.join(by_name) or 'none'})")
        shape = _one_element_shape(value, input_shapes.get(name))
        scalars = [parse_value(name, text, value.dtype) for text in texts] if texts is not None \
            else compared_values(graph, value)
        if len(set(scalars)) != len(scalars):
            raise CortexError(f"--specialize {name}: each value once (as {dtypes.name(value.dtype)}, "
                              f"{', '.join(texts or [])} repeat one)")
        columns.append([(name, np.full(shape, s, dtype=dtypes.to_numpy(value.dtype))) for s in scalars])
    return [dict(row) for row in itertools.product(*columns)]


def parse_value(name: str, text: str, dtype: int):
    """One value as the input's dtype holds it (a Python bool, int or float), or one error."""
    kind = _kind(name, dtype)
    numpy_type = dtypes.to_numpy(dtype).type
    wrong = CortexError(f"--specialize {name}={text}: the input is {dtypes.name(dtype)}, which cannot hold {text!r}")
    if kind == "b":
        if text.lower() not in _BOOLEANS:
            raise wrong
        return _BOOLEANS[text.lower()]
    if kind in "iu":
        limits = np.iinfo(numpy_type)
        if not _INTEGER.match(text) or not limits.min <= int(text) <= limits.max:
            raise wrong
        return int(text)
    try:
        number = float(text)
    except ValueError:
        raise wrong from None
    with np.errstate(over="ignore"):
        held = numpy_type(number)
    if not np.isfinite(held):
        raise wrong
    return held.item()


def compared_values(graph: Graph, value: Value) -> list:
    """The constants an If's condition compares `value` with (Equal(value, C), through casts and
    reshapes), as its dtype holds them, in the order the model compares them."""
    found = []
    for node in graph.walk():
        if node.op_type != "If":
            continue
        equal = _source(node.inputs[0]).producer
        if equal is None or equal.op_type != "Equal":
            continue
        for compared, constant in (equal.inputs, reversed(equal.inputs)):
            if _source(compared) is value and constant.const is not None and constant.const.size == 1:
                held = constant.const.astype(dtypes.to_numpy(value.dtype)).reshape(())
                if held == constant.const.reshape(()) and held.item() not in found:
                    found.append(held.item())
    if not found:
        raise CortexError(f"--specialize {value.name}: found no If that compares {value.name} with a constant; "
                          f"give the values: --specialize {value.name}=V1,V2,...")
    if len(found) == 1:      # the If's other branch takes every other value: which ones is the user's to say
        raise CortexError(f"--specialize {value.name}: the model's If compares {value.name} with {_text(found[0])} "
                          f"only and takes its other branch for any other value; give the values: "
                          f"--specialize {value.name}={_text(found[0])},OTHER")
    return found


def values_text(values: dict) -> str:
    """`sr=8000`, as a section's name and the errors spell its values."""
    return ",".join(f"{name}={_text(v)}" for name, v in values.items())


def _text(value) -> str:
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)[0]
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    return str(value)


def _kind(name: str, dtype: int) -> str:
    try:
        kind = dtypes.to_numpy(dtype).kind
    except (KeyError, TypeError, ValueError):
        kind = ""
    if kind not in ("b", "i", "u", "f"):
        raise CortexError(f"--specialize {name}: the input is {dtypes.name(dtype)}; value specializations take "
                          "booleans, integers and floats")
    return kind


def _one_element_shape(value: Value, bound: tuple[int, ...] | None) -> tuple[int, ...]:
    """The input's shape, which must hold one element (a scalar, [1], [1, 1]...): a value names it."""
    shape = bound if bound is not None else value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        raise CortexError(f"--specialize {value.name}: its shape is not static; bind it with --input-shape "
                          f"{value.name}=1 (or scalar)")
    if int(np.prod(shape)) != 1:
        raise CortexError(f"--specialize {value.name}: the input has shape {list(shape)}; a value specialization "
                          "takes an input of one element (a scalar, or [1])")
    return tuple(shape)


def _source(value: Value | None) -> Value | None:
    """`value` before the ops that keep it (casts, reshapes)."""
    while value is not None and value.producer is not None and value.producer.op_type in _KEEPS_VALUE \
            and value.producer.present_inputs:
        value = value.producer.present_inputs[0]
    return value
