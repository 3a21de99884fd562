"""What a server tells clients about a model compiled for several input shapes or input values (a
cortex.dag/2 dag.json): each tensor's shape with -1 on every axis whose extent differs between the
specializations (KServe v2's spelling of a variable dim), the shapes that were compiled, and the
names of the specializations in the same order (`sr=8000;sr=16000` lists the compiled values of an
input specialised by value, which stays one of the model's inputs).

The protocol's parameters are scalars, so the lists are strings: a tensor's `cortex_shapes` is
its shape in each specialization (`2x16;4x16;8x16`), the model's `cortex_specializations` their
names (`batch=2;batch=4;batch=8`), and `cortex_pad_to_bucket` the dim padded along, when the server
pads. Which shapes a request may have is the model's rule (`SpecializedModel.specialization_for`),
never re-stated here.
"""

from __future__ import annotations

from cortex.specializations import frozen_specs

SEPARATOR = ";"         # specialization names hold commas (batch=1,seq=32)


def varying_specs(sections: list[dict], key: str) -> list[dict]:
    """The `key` ("inputs" or "outputs") specs of the first specialization, each with -1 on the
    axes that differ between specializations and its shape in each of them under `shapes`."""
    specs = []
    tensors = [[*s[key], *(frozen_specs(s, s.get("input_values", {})) if key == "inputs" else ())] for s in sections]
    for spec in tensors[0]:
        shapes = [list(next(t for t in mine if t["name"] == spec["name"])["shape"]) for mine in tensors]
        specs.append({**spec, "shape": merged_shape(shapes), "shapes": shapes})
    return specs


def merged_shape(shapes: list[list[int]]) -> list[int]:
    """One shape for all: an axis's extent where every shape agrees on it, else -1 (every axis -1
    when the ranks differ: then no axis lines up)."""
    if len({len(shape) for shape in shapes}) > 1:
        return [-1] * max(len(shape) for shape in shapes)
    return [extents[0] if len(set(extents)) == 1 else -1 for extents in zip(*shapes)]


def tensor_parameters(spec: dict) -> dict:
    """A varying spec's `cortex_shapes` parameter; none for a tensor of one shape."""
    if "shapes" not in spec:
        return {}
    return {"cortex_shapes": SEPARATOR.join("x".join(map(str, shape)) or "scalar" for shape in spec["shapes"])}


def model_parameters(sections: list[dict], pad_to_bucket: str | None) -> dict:
    parameters = {"cortex_specializations": SEPARATOR.join(s["name"] for s in sections)}
    if pad_to_bucket is not None:
        parameters["cortex_pad_to_bucket"] = pad_to_bucket
    return parameters
