"""Reading Loop and Scan nodes: how many iterations they run and where their operands sit.

Shape inference, the unrolling pass and the loop-nest lowering all ask these questions; the
answers live here once. A Loop runs `min(M, until cond is false)` iterations: it has a static trip
count when M is a constant and its condition can never stop it early (absent or a constant true
on entry, and a body that passes it through unchanged or sets it to a constant true). Otherwise the
count is data-dependent, and only an upper bound (M, or the length a scan output declares) lets
it compile, each iteration guarded at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ir import dtypes
from ir.graph import Graph, Node, Value

BOOL = dtypes.onnx.TensorProto.BOOL


@dataclass(frozen=True)
class LoopTrips:
    count: int | None       # the iterations, when known statically
    bound: int | None       # at most this many (== count when known)
    stops_early: bool       # whether a run-time test (M from data, the condition) may stop it sooner


def loop_trips(node: Node) -> LoopTrips:
    body: Graph = node.attrs["body"]
    m = node.inputs[0] if node.inputs and node.inputs[0] is not None else None
    cond = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1] is not None else None
    limit = int(np.asarray(m.const).reshape(-1)[0]) if m is not None and m.is_const else None
    if limit is not None:
        limit = max(limit, 0)
    entry_true = cond is None or (cond.is_const and bool(np.asarray(cond.const).reshape(-1)[0]))
    stays = _passes_condition_through(body) or (entry_true and _always_true(body.outputs[0]))
    stops_early = not (entry_true and stays) or (m is not None and limit is None)
    if m is None and not stops_early:
        return LoopTrips(None, None, False)          # an infinite loop: nothing bounds it
    bound = limit
    scans = scan_output_lengths(node)
    if scans:
        bound = min(scans) if bound is None else min(bound, *scans)
    return LoopTrips(None if stops_early else limit, bound, stops_early)


def scan_output_lengths(node: Node) -> list[int]:
    """The static lengths of a Loop's scan outputs (the declared or inferred first dim)."""
    carried = len(node.inputs) - 2
    return [int(v.shape[0]) for v in node.outputs[carried:]
            if v.shape and isinstance(v.shape[0], int)]


def _passes_condition_through(body: Graph) -> bool:
    return len(body.inputs) > 1 and _through_identities(body.outputs[0]) is body.inputs[1]


def _always_true(value: Value) -> bool:
    v = _through_identities(value)
    return v.is_const and np.asarray(v.const).size == 1 and bool(np.asarray(v.const).reshape(-1)[0])


def _through_identities(value: Value) -> Value:
    while value.producer is not None and value.producer.op_type == "Identity" and not value.producer.domain:
        value = value.producer.inputs[0]
    return value


@dataclass(frozen=True)
class ScanLayout:
    """Where a Scan's operands sit. Inputs: [sequence_lens (opset 8)] + states + scan inputs;
    outputs: states + scan outputs. Axes are non-negative against the outer rank, directions 0
    forward and 1 reverse. `batched`: opset 8's form, where axis 0 is a batch that every operand
    has and the body never sees, and the scan axis is 1."""
    states: int
    scan_inputs: int
    input_axes: tuple[int, ...]
    input_directions: tuple[int, ...]
    output_axes: tuple[int, ...]
    output_directions: tuple[int, ...]
    batched: bool

    @property
    def first_state(self) -> int:
        return 1 if self.batched else 0

    def state_inputs(self, node: Node) -> list[Value]:
        return node.inputs[self.first_state:self.first_state + self.states]

    def scanned_inputs(self, node: Node) -> list[Value]:
        return node.inputs[self.first_state + self.states:]


def scan_layout(node: Node, opset: int) -> ScanLayout | None:
    """None while an operand's rank is unknown (its axes cannot be normalised yet)."""
    batched = opset < 9
    m = int(node.attrs.get("num_scan_inputs", 0))
    first = 1 if batched else 0
    n = len(node.inputs) - first - m
    k = len(node.outputs) - n
    scans = node.inputs[first + n:]
    if any(v is None or v.shape is None for v in scans):
        return None
    if batched:
        directions = tuple(int(d) for d in node.attrs.get("directions", [0] * m))
        return ScanLayout(n, m, (1,) * m, directions, (1,) * k, (0,) * k, True)
    in_axes = [int(a) for a in node.attrs.get("scan_input_axes", [0] * m)]
    in_axes = tuple(a + len(v.shape) if a < 0 else a for a, v in zip(in_axes, scans))
    body_outputs = node.attrs["body"].outputs[n:]
    out_axes = [int(a) for a in node.attrs.get("scan_output_axes", [0] * k)]
    if any(a < 0 for a in out_axes):
        if any(v.shape is None for v in body_outputs):
            return None
        out_axes = [a + len(v.shape) + 1 if a < 0 else a for a, v in zip(out_axes, body_outputs)]
    return ScanLayout(n, m, in_axes, tuple(int(d) for d in node.attrs.get("scan_input_directions", [0] * m)),
                      tuple(out_axes), tuple(int(d) for d in node.attrs.get("scan_output_directions", [0] * k)), batched)


def scan_length(node: Node, layout: ScanLayout) -> int | None:
    """The iterations of a Scan: the length of its scan axis, when static."""
    lengths = {v.shape[a] for v, a in zip(layout.scanned_inputs(node), layout.input_axes)}
    if len(lengths) != 1:
        return None
    (length,) = lengths
    return length if isinstance(length, int) else None


def body_input_types(node: Node, opset: int) -> list[tuple[int, tuple | None]]:
    """(dtype, shape) of each body input as the first iteration sees it."""
    if node.op_type == "Loop":
        carried = [(v.dtype, v.shape) if v is not None else (dtypes.UNDEFINED, None) for v in node.inputs[2:]]
        return [(dtypes.INT64, ()), (BOOL, ()), *carried]
    layout = scan_layout(node, opset)
    if layout is None:
        return []
    drop_batch = 1 if layout.batched else 0
    types = [(v.dtype, None if v.shape is None else tuple(v.shape[drop_batch:])) for v in layout.state_inputs(node)]
    for v, axis in zip(layout.scanned_inputs(node), layout.input_axes):
        shape = tuple(d for i, d in enumerate(v.shape) if i != axis and not (layout.batched and i == 0))
        types.append((v.dtype, shape))
    return types
