"""The op registry: the one place that says what Cortex knows about each op.

An entry holds the op's kind (how fusion and partitioning treat it), its shape rule, which inputs are
weights and how its weight splits along output channels, whether its output is a view of its input,
what a GEMM or Conv kernel may absorb of it as an epilogue, its cost in flops, and the lowerings
backends register next to it. Passes and backends ask the registry these questions (`is_view`,
`epilogue_of`, `node_flops`...) rather than keep lists of op names of their own.

The shape rule defaults to the op's ONNX schema inference, which covers every standard op; an entry
overrides it only where ONNX's rule is missing. The flop rule defaults to one operation per output
element; contractions override it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ir.graph import Node

# How an op behaves, for the passes that group and split nodes.
ELEMENTWISE = "elementwise"    # one output element from the same position of each (broadcast) input
CONTRACTION = "contraction"    # MatMul, Gemm, Conv: weights with output channels; a fusion anchor
NORMALIZATION = "normalization"
REDUCTION = "reduction"
LAYOUT = "layout"              # moves or views data without arithmetic
SHAPE = "shape"                # computes shapes; folded away once inputs are bound
CONTROL = "control"
RANDOM = "random"              # never folded, never deduplicated
OTHER = "other"


@dataclass(frozen=True)
class Epilogue:
    """What a GEMM or Conv kernel can do of an op that reads its result, in the kernel's last pass."""
    bias: bool = False                  # an Add of a constant per-output-channel vector
    residual: bool = False              # an Add (or a Sum of two) of a tensor of the result's exact shape
    activation: str | None = None       # the activation the kernel applies last ("relu", "gelu")
    applies: Callable | None = None     # node -> whether its attributes are the form the kernel computes


@dataclass
class OpDef:
    op_type: str
    domain: str = ""
    kind: str = OTHER
    # (node, opset) -> (dtype, shape) or None per output, filling in what ONNX's schema inference
    # leaves unknown (InferShapes applies it after ONNX's); None: ONNX's alone.
    shape_rule: Callable | None = None
    # Which input holds the weight whose output channels a too-large op is split along, and the
    # axis of that weight and of the output that the channels live on.
    weight_input: int | None = None
    weight_axis: Callable | None = None     # node -> axis of the weight holding output channels
    output_axis: Callable | None = None     # node -> axis of the output holding those channels
    # The output holds exactly the first input's bytes in the same order (Reshape, Identity...): it
    # can be the input's memory, and is a no-op when the shapes agree.
    view: bool = False
    epilogue: Epilogue | None = None
    # A contraction whose kernel takes an epilogue though it names no weight to split along
    # (MatMulInteger: the Cast, scale Mul and bias Add of MatMulIntegerToFloat); contractions with a
    # `weight_input` always may. FuseGroups starts a group at either.
    fusion_anchor: bool = False
    # node -> floating-point operations, from static shapes; None: one per output element.
    flops: Callable | None = None
    # node -> onnx.FunctionProto computing the op from other registered ops, its formal inputs and
    # outputs in the node's order. The expand-ops pass replaces such a node by that body before
    # shape inference, so partitioning, fusion and every backend see ordinary ops (onnxruntime's
    # contrib ops, whose fused forms the backends need not know).
    expansion: Callable | None = None
    # On 8-bit data the op computes what it computes on the dequantized values, given one per-tensor
    # scale (positive) and zero point for its data inputs and output: it only moves or selects
    # elements, or takes their max. A DequantizeLinear before it and a QuantizeLinear with the same
    # parameters after it can then go (onnxruntime's DropQDQNodes).
    quantized_exact: bool = False
    # node -> per output (static upper-bound shape, bounded axis or None): an op whose output
    # length depends on its input data (NonZero, Unique...); see ir/bounds.py.
    bounds: Callable | None = None
    # Reads a padded bounded input correctly (ir/bounds.py): the real slots of its outputs depend
    # only on real slots of its inputs. Elementwise ops always do.
    keeps_bound: bool = False
    # node, lo, hi -> ({input index: constant}, {attribute: value}) of the op computing output
    # channels [lo, hi) only, for an op whose weights do not hold their channels on one axis
    # (MatMulNBits' flat scales); None: each weight input is sliced on its channel axis. Its
    # {input index: ...} keys are the same for every range, an empty one included.
    slice_channels: Callable | None = None
    # node -> whether the op quantizes an activation at run time (its scale and codes computed from
    # the data, DynamicQuantizeLinear's way): a last-bit difference in its float input may move its
    # results by a quantization step. None: never.
    quantizes_activations: Callable | None = None
    # node -> whether the lowerings cover this node's form; None: every form. A node they do not
    # cover is one no target lowers (a fallback CU's, under --fallback onnxruntime).
    lowered_when: Callable | None = None
    lowerings: dict[str, Callable] = field(default_factory=dict)

    @property
    def deterministic(self) -> bool:
        return self.kind != RANDOM


REGISTRY: dict[tuple[str, str], OpDef] = {}


def register(*op_types: str, domain: str = "", kind: str = OTHER, **fields) -> None:
    for op_type in op_types:
        if (domain, op_type) in REGISTRY:
            raise ValueError(f"op {domain}::{op_type} registered twice")
        REGISTRY[(domain, op_type)] = OpDef(op_type, domain, kind, **fields)


def lookup(op_type: str, domain: str = "") -> OpDef | None:
    return REGISTRY.get(("" if domain == "ai.onnx" else domain, op_type))


def lowering(backend: str, *op_types: str, domain: str = ""):
    """Decorator a backend uses to attach its lowering of ops to their registry entries."""
    def attach(fn):
        for op_type in op_types:
            entry = lookup(op_type, domain)
            if entry is None:
                raise ValueError(f"cannot lower unregistered op {domain}::{op_type}")
            entry.lowerings[backend] = fn
        return fn
    return attach


def view_ops() -> frozenset[str]:
    """The op types of the default domain whose output is a view of their first input."""
    return frozenset(op_type for (domain, op_type), entry in REGISTRY.items() if entry.view and not domain)


def quantizes_activations(node: Node) -> bool:
    entry = lookup(node.op_type, node.domain)
    return entry is not None and entry.quantizes_activations is not None and bool(entry.quantizes_activations(node))


def is_quantized_exact(op_type: str, domain: str = "") -> bool:
    entry = lookup(op_type, domain)
    return entry is not None and entry.quantized_exact


def is_view(op_type: str, domain: str = "") -> bool:
    entry = lookup(op_type, domain)
    return entry is not None and entry.view


def bounds_of(node: Node) -> list | None:
    """The static upper bound of each output of a data-dependent op (`OpDef.bounds`); None for
    any other op."""
    entry = lookup(node.op_type, node.domain)
    return entry.bounds(node) if entry is not None and entry.bounds is not None else None


def keeps_bound(node: Node) -> bool:
    """Whether `node` computes the right result from padded bounded inputs (ir/bounds.py)."""
    entry = lookup(node.op_type, node.domain)
    return entry is not None and (entry.kind == ELEMENTWISE or entry.keeps_bound)


def kind_of(op_type: str, domain: str = "") -> str:
    entry = lookup(op_type, domain)
    return entry.kind if entry else OTHER


def epilogue_of(node: Node) -> Epilogue | None:
    """What a contraction's kernel can absorb of `node`, given its attributes; None: nothing."""
    entry = lookup(node.op_type, node.domain)
    found = entry.epilogue if entry is not None else None
    if found is None or (found.applies is not None and not found.applies(node)):
        return None
    return found


def epilogue_activations() -> tuple[str, ...]:
    """The activations some op asks a kernel's epilogue for, in registration order."""
    return tuple(dict.fromkeys(entry.epilogue.activation for entry in REGISTRY.values()
                               if entry.epilogue is not None and entry.epilogue.activation))


# -- the cost model: floating-point operations per node, from static shapes only -----------------
# Good enough to rank CUs and find the critical path of a schedule; not a performance prediction.

def node_flops(node: Node) -> int:
    entry = lookup(node.op_type, node.domain)
    rule = entry.flops if entry is not None and entry.flops is not None else output_elements
    return rule(node)


def output_elements(node: Node) -> int:
    """The default cost: one operation per output element."""
    return sum(static_numel(v.shape) for v in node.outputs)


def static_numel(shape) -> int:
    if shape is None:
        return 0
    return math.prod(static_dim(d) for d in shape)


def static_dim(d) -> int:
    """A dimension's size; one not known statically (a symbol) counts as 1."""
    return d if isinstance(d, int) else 1
