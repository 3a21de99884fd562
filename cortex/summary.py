"""What `cortex inspect` reports about a graph: interface, op counts, parameters, dynamic dims."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from ir import dtypes
from ir.graph import Graph, Value
from ir.ops import CONTROL, kind_of, lookup


@dataclass
class TensorSummary:
    name: str
    dtype: str
    shape: list | None

    @classmethod
    def of(cls, v: Value) -> "TensorSummary":
        return cls(v.name, dtypes.name(v.dtype) if v.is_tensor else "non-tensor",
                   None if v.shape is None else list(v.shape))


@dataclass
class GraphSummary:
    opsets: dict[str, int]
    inputs: list[TensorSummary]
    outputs: list[TensorSummary]
    node_count: int
    op_counts: dict[str, int]
    param_count: int
    param_bytes: int
    dynamic_dims: list[str]
    control_flow: list[str]
    unknown_ops: list[str] = field(default_factory=list)   # not in Cortex's op registry
    unlowered_ops: dict[str, list[str]] = field(default_factory=dict)  # backend -> ops without lowering
    # Tensors a node reads or the model outputs whose shape is not static, as "name (op)".
    unknown_shapes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def summarize_graph(graph: Graph, backends: tuple[str, ...] = ()) -> GraphSummary:
    ops = Counter(_qualified(n) for n in graph.walk())
    consts = graph.constants()
    # A named dim once by its name; an unnamed one (`?`, or `-1` as some exporters write it) by
    # its input and axis, the place `--input-shape` binds it.
    dynamic = sorted({str(d) if d is not None else f"{v.name}[{axis}]"
                      for v in graph.inputs if v.shape for axis, d in enumerate(v.shape) if not isinstance(d, int)}
                     | {f"{v.name}: unknown rank" for v in graph.inputs if v.is_tensor and v.shape is None})
    control = sorted({f"{n.op_type} {n.name!r}" for n in graph.walk() if kind_of(n.op_type, n.domain) == CONTROL})
    unknown = sorted({_qualified(n) for n in graph.walk() if lookup(n.op_type, n.domain) is None})
    unlowered = {b: sorted({_qualified(n) for n in graph.walk()
                            if (e := lookup(n.op_type, n.domain)) is None or b not in e.lowerings})
                 for b in backends}
    return GraphSummary(
        opsets=dict(graph.opset_imports),
        inputs=[TensorSummary.of(v) for v in graph.inputs],
        outputs=[TensorSummary.of(v) for v in graph.outputs],
        node_count=sum(ops.values()),
        op_counts=dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        param_count=sum(int(v.const.size) for v in consts),
        param_bytes=sum(int(v.const.nbytes) for v in consts if v.const.dtype != object),
        dynamic_dims=dynamic,
        control_flow=control,
        unknown_ops=unknown,
        unlowered_ops=unlowered,
        unknown_shapes=_unknown_shapes(graph),
    )


def _unknown_shapes(graph: Graph) -> list[str]:
    read = {id(v) for node in graph.walk() for v in node.present_inputs} | {id(v) for v in graph.outputs}
    return [f"{out.name} ({_qualified(node)})" for node in graph.walk() for out in node.outputs
            if id(out) in read and out.is_tensor and not out.is_static]


def _qualified(node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
