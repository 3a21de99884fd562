"""What a node-test case is about: the op it exercises, whether it is in scope, its tolerances.

Everything is read from the case's own graph (op types, domains, attributes, value types), never
from its name: the node tests are single-op models, and the `*_expanded` ones are the op's function
body, whose intermediate values onnx names `<Op>_<case>_expanded_function_<name>`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper

from ir.errors import CortexError
from ir.onnx_import import import_model
from passes.infer_shapes import InferShapes

# The default tolerance of onnx's backend-test runner (onnx.backend.test.runner) for every node case.
RTOL, ATOL = 1e-3, 1e-7
# The runner's own bfloat16 rule: two bfloat16 ulps of relative error. float16 gets the same two-ulp
# allowance (2 * 2**-10): the default rtol is one float16 ulp, less than a correctly rounded result
# computed in float32 may differ by after a second rounding.
HALF_RTOL = {"bfloat16": 2**-6, "float16": 2**-9}
# onnxruntime's backend-test overrides (onnxruntime/test/testdata/onnx_backend_test_series_overrides.jsonc).
ATOL_OVERRIDES = {"test_dft": 1e-4, "test_dft_axis": 1e-4}

TRAINING_DOMAIN = "ai.onnx.preview.training"
# Ops whose outputs are drawn at random: no reference can be reproduced bit for bit.
RANDOM_OPS = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}
_FUNCTION_VALUE = re.compile(r"^([A-Za-z][A-Za-z0-9]*)_.+_expanded_function_")


@dataclass(frozen=True)
class CaseInfo:
    op: str                 # the row of the table: "Conv", "Softmax (expanded)", "com.microsoft.Gelu"
    out_of_scope: str | None  # why the case is not counted, or None


def describe_case(model: onnx.ModelProto) -> CaseInfo:
    return CaseInfo(case_op(model), out_of_scope_reason(model))


def case_op(model: onnx.ModelProto) -> str:
    graph = model.graph
    for node in graph.node:
        for name in node.output:
            m = _FUNCTION_VALUE.match(name)
            if m:
                return f"{m.group(1)} (expanded)"
    ops = sorted({_qualified(n) for n in graph.node} - {"Constant"}) or sorted({_qualified(n) for n in graph.node})
    if len(ops) == 1:
        return ops[0]
    # A multi-op graph onnx did not name as a function body (the `_ver18` expansions of older opsets)
    return "+".join(ops) if len(ops) <= 3 else f"{'+'.join(ops[:3])}+... ({len(ops)} op types)"


def out_of_scope_reason(model: onnx.ModelProto) -> str | None:
    nodes = list(_all_nodes(model.graph))
    for node in nodes:
        if node.domain == TRAINING_DOMAIN:
            return f"training op ({node.op_type})"
        if node.op_type in RANDOM_OPS:
            return f"random outputs ({node.op_type})"
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            return "random outputs (Dropout with training_mode)"
        if node.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i for a in node.attribute):
            return "training op (BatchNormalization with training_mode=1)"
    for kind, elem in _value_types(model):
        if kind != "tensor_type":
            return f"{kind.removesuffix('_type')} values"
        if elem == onnx.TensorProto.STRING:
            return "string tensors"
    return None


def tolerances(case_name: str, expected: np.ndarray) -> tuple[float, float]:
    rtol = HALF_RTOL.get(np.asarray(expected).dtype.name, RTOL)
    return rtol, ATOL_OVERRIDES.get(case_name, ATOL)


def parameter_inputs(model: onnx.ModelProto, values: dict | None = None) -> list[str]:
    """Graph inputs that carry op parameters rather than the data computed on, in the model's input
    order. Two kinds qualify, and never a graph output:
    - integer parameters: int32/int64, read by at least one node and always at an input index >= 1,
      never as a node's data input 0 (axes, pads, starts/ends, sizes, k, repeats, shape...);
    - shape parameters (`values` given: the case's inputs): an input of any type whose value decides
      an output's shape, i.e. shape inference leaves fewer shapes open once it is a constant (a window's size, Range's start/limit/delta,
      OneHot's depth, Resize's float scales). An input whose shape alone matters never qualifies."""
    integer = (onnx.TensorProto.INT32, onnx.TensorProto.INT64)
    outputs = {o.name for o in model.graph.output}
    initializers = {i.name for i in model.graph.initializer}
    deciding = set(shape_deciding_inputs(model, values)) if values is not None else set()
    found = []
    for vi in model.graph.input:
        if vi.name in initializers or vi.name in outputs or not vi.type.HasField("tensor_type"):
            continue
        slots = [i for node in _all_nodes(model.graph) for i, name in enumerate(node.input) if name == vi.name]
        if vi.name in deciding or (vi.type.tensor_type.elem_type in integer and slots and all(i >= 1 for i in slots)):
            found.append(vi.name)
    return found


def shape_deciding_inputs(model: onnx.ModelProto, values: dict) -> list[str]:
    """The tensor inputs in `values` (name -> array) whose value, made a constant, lets Cortex's
    shape inference (ONNX's rules alternating with constant folding, as decompose runs it) leave
    fewer values without a static shape: alone, or as the one input missing when all the others
    are constants (Range's start, limit and delta decide its length only together). The declared
    shapes of outputs and intermediate values are dropped first: they would hide what is derived."""
    tensors = {k: np.asarray(v) for k, v in values.items() if isinstance(v, np.ndarray)}
    outputs = {o.name for o in model.graph.output}
    names = [vi.name for vi in model.graph.input if vi.name in tensors and vi.name not in outputs]
    none = _unknown_shape_count(model, tensors, frozen=())
    every = _unknown_shape_count(model, tensors, frozen=tuple(names))
    return [name for name in names
            if _unknown_shape_count(model, tensors, frozen=(name,)) < none
            or _unknown_shape_count(model, tensors, frozen=tuple(n for n in names if n != name)) > every]


def _unknown_shape_count(model: onnx.ModelProto, tensors: dict, frozen: tuple) -> float:
    """How many values shape inference leaves without a static shape (infinitely many when it
    refuses the model) with the inputs in `frozen` made constants and the others bound."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    graph = probe.graph
    del graph.value_info[:]
    for o in graph.output:
        o.type.tensor_type.ClearField("shape")
    kept = [vi for vi in graph.input if vi.name not in frozen]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.extend(onnx.numpy_helper.from_array(tensors[name], name) for name in frozen)
    shapes = {vi.name: tuple(tensors[vi.name].shape) for vi in kept if vi.name in tensors}
    try:
        inferred = InferShapes(input_shapes=shapes).run(import_model(probe))
    except CortexError:
        return math.inf
    return sum(1 for node in inferred.walk() for v in node.outputs if v.is_tensor and not v.is_static)


def _qualified(node: onnx.NodeProto) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _all_nodes(sub)


def _value_types(model: onnx.ModelProto):
    """(kind, tensor elem type) of every graph input/output and every value onnx can infer."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference fails on some valid cases (e.g. functions it cannot expand)
        inferred = model
    graph = inferred.graph
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        kind = vi.type.WhichOneof("value")
        if kind is None:
            continue
        elem = vi.type.tensor_type.elem_type if kind == "tensor_type" else None
        yield kind, elem
