"""The Cortex IR: a `Graph` of `Node`s over `Value`s.

A value is produced by at most one node (SSA). Constants are values with `const` set and no
producer; graph inputs are values with neither. Shapes hold ints for static dims and strings for
named symbolic dims (`None` where nothing is known); `shape is None` means the rank is unknown.
Subgraphs (If/Loop/Scan bodies) are `Graph`s stored in node attributes; their nodes may use values
of the enclosing graphs directly, the way ONNX resolves outer-scope names.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import onnx

from ir import dtypes

Dim = int | str | None
Shape = tuple[Dim, ...]


@dataclass(eq=False)
class Value:
    name: str
    dtype: int = dtypes.UNDEFINED
    shape: Shape | None = None
    const: np.ndarray | None = None
    # Non-tensor types (sequence, optional, map, sparse) are carried through untouched.
    type_proto: onnx.TypeProto | None = None
    producer: Node | None = field(default=None, repr=False)
    # Axes a graph output or value_info declared as 0: a hint, not a fact (some exporters write 0
    # for a dynamic dim), used only where inference finds nothing (an output sized by an input's value).
    declared_zero_axes: tuple[int, ...] = field(default=(), repr=False, compare=False)
    # A data-dependent length (NonZero, Compress, Unique, NonMaxSuppression and what reads them):
    # `shape[bound_axis]` is a static upper bound, the real length is known only at run time and
    # lives in a companion scalar that every value of the same `length_key` shares (ir/bounds.py).
    bound_axis: int | None = field(default=None, repr=False, compare=False)
    length_key: str | None = field(default=None, repr=False, compare=False)

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def is_tensor(self) -> bool:
        return self.type_proto is None

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    @property
    def is_bounded(self) -> bool:
        return self.bound_axis is not None

    @property
    def numel(self) -> int:
        if not self.is_static:
            raise ValueError(f"value {self.name!r} has no static shape: {self.shape}")
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)

    def __repr__(self) -> str:
        kind = "const " if self.is_const else ""
        return f"<{kind}{self.name}: {dtypes.name(self.dtype)}{list(self.shape) if self.shape is not None else '?'}>"


@dataclass(eq=False)
class Node:
    op_type: str
    inputs: list[Value | None]  # None marks an omitted optional input
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""
    # ONNX attribute types as imported, so `[]` round-trips as INTS or FLOATS as it came.
    attr_types: dict[str, int] = field(default_factory=dict)
    doc_string: str = ""
    # Set by the fusion pass: nodes sharing a group run as one kernel and are never split apart.
    fusion_group: str | None = None

    def __post_init__(self):
        for out in self.outputs:
            out.producer = self

    @property
    def subgraphs(self) -> list[Graph]:
        found = []
        for value in self.attrs.values():
            if isinstance(value, Graph):
                found.append(value)
            elif isinstance(value, list):
                found.extend(v for v in value if isinstance(v, Graph))
        return found

    @property
    def present_inputs(self) -> list[Value]:
        return [v for v in self.inputs if v is not None]

    def describe(self) -> str:
        """How errors name a node: its name and op type."""
        op = self.op_type if not self.domain else f"{self.domain}::{self.op_type}"
        return f"node {self.name!r} ({op})"

    def __repr__(self) -> str:
        ins = ", ".join(v.name if v else "" for v in self.inputs)
        outs = ", ".join(v.name for v in self.outputs)
        return f"<{self.op_type} {self.name!r}: ({ins}) -> ({outs})>"


@dataclass(eq=False)
class Graph:
    name: str = "main"
    nodes: list[Node] = field(default_factory=list)
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    opset_imports: dict[str, int] = field(default_factory=lambda: {"": 21})
    ir_version: int = onnx.IR_VERSION
    producer_name: str = "cortex"
    producer_version: str = ""
    model_version: int = 0
    doc_string: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    # Model-local functions and their opsets, carried through unchanged.
    functions: list[onnx.FunctionProto] = field(default_factory=list)
    # Constants that no node uses but that the model declared (kept so round trips are faithful).
    parent: Graph | None = field(default=None, repr=False)

    # -- walking ------------------------------------------------------------------------------
    def walk(self) -> Iterator[Node]:
        """Every node, including those inside subgraphs (depth first)."""
        for node in self.nodes:
            yield node
            for sub in node.subgraphs:
                yield from sub.walk()

    def values(self) -> list[Value]:
        """Every value this graph's nodes touch (inputs, outputs, constants), in first-use order."""
        seen: dict[int, Value] = {}
        for v in self.inputs:
            seen.setdefault(id(v), v)
        for node in self.nodes:
            for v in itertools.chain(node.present_inputs, node.outputs):
                seen.setdefault(id(v), v)
        for v in self.outputs:
            seen.setdefault(id(v), v)
        return list(seen.values())

    def constants(self) -> list[Value]:
        """Constants used by this graph's own nodes or outputs, in first-use order."""
        return [v for v in self.values() if v.is_const]

    def users(self) -> dict[Value, list[Node]]:
        """Value -> nodes of this graph that read it (a subgraph's reads count for its owner)."""
        found: dict[Value, list[Node]] = {}
        for node in self.nodes:
            for v in node.present_inputs:
                found.setdefault(v, []).append(node)
            for v in _outer_reads(node):
                lst = found.setdefault(v, [])
                if not lst or lst[-1] is not node:
                    lst.append(node)
        return found

    def param_count(self) -> int:
        """Elements held in constants, the measure of a model's or CU's size."""
        return sum(int(v.const.size) for v in self.constants())

    # -- editing ------------------------------------------------------------------------------
    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Make every reader of `old` (subgraphs and graph outputs included) read `new`."""
        for node in self.walk():
            for i, v in enumerate(node.inputs):
                if v is old:
                    node.inputs[i] = new
        for g in self._all_graphs():
            g.outputs = [new if v is old else v for v in g.outputs]

    def _all_graphs(self) -> Iterator[Graph]:
        yield self
        for node in self.walk():
            yield from node.subgraphs

    def topologically_sort(self) -> None:
        """Order nodes so that every node comes after its producers (stable for sorted input)."""
        produced_here = {id(out): node for node in self.nodes for out in node.outputs}
        order: list[Node] = []
        state: dict[int, int] = {}  # 1 = visiting, 2 = done
        for root in self.nodes:
            if state.get(id(root)):
                continue
            stack = [(root, iter(_node_deps(root, produced_here)))]
            state[id(root)] = 1
            while stack:
                node, deps = stack[-1]
                dep = next(deps, None)
                if dep is None:
                    stack.pop()
                    state[id(node)] = 2
                    order.append(node)
                elif state.get(id(dep)) == 1:
                    raise CycleError(dep)
                elif not state.get(id(dep)):
                    state[id(dep)] = 1
                    stack.append((dep, iter(_node_deps(dep, produced_here))))
        self.nodes = order

    def fresh_name(self, base: str) -> str:
        """A value or node name not used anywhere in the model."""
        taken = self._names()
        if base not in taken:
            taken.add(base)
            return base
        for i in itertools.count(1):
            candidate = f"{base}_{i}"
            if candidate not in taken:
                taken.add(candidate)
                return candidate
        raise AssertionError("unreachable")

    def _names(self) -> set[str]:
        root = self
        while root.parent is not None:
            root = root.parent
        cache = getattr(root, "_name_cache", None)
        if cache is None:
            cache = set()
            for g in root._all_graphs():
                cache.update(v.name for v in g.values())
                cache.update(n.name for n in g.nodes)
            root._name_cache = cache
        return cache


class CycleError(Exception):
    def __init__(self, node: Node):
        super().__init__(f"the graph has a cycle through {node.describe()}")
        self.node = node


def _node_deps(node: Node, produced_here: dict[int, Node]) -> list[Node]:
    deps = []
    for v in itertools.chain(node.present_inputs, _outer_reads(node)):
        producer = produced_here.get(id(v))
        if producer is not None:
            deps.append(producer)
    return deps


def _outer_reads(node: Node) -> list[Value]:
    """Values a node's subgraphs read from outside themselves (captured outer-scope values)."""
    if not node.subgraphs:
        return []
    reads: list[Value] = []
    for sub in node.subgraphs:
        defined = {id(v) for v in sub.inputs}
        for inner in sub.walk():
            defined.update(id(o) for o in inner.outputs)
            for s in inner.subgraphs:
                defined.update(id(v) for v in s.inputs)
        for inner in sub.walk():
            for v in inner.present_inputs:
                if id(v) not in defined and not v.is_const:
                    reads.append(v)
        reads.extend(v for v in sub.outputs if id(v) not in defined and not v.is_const)
    unique: dict[int, Value] = {}
    for v in reads:
        unique.setdefault(id(v), v)
    return list(unique.values())


def outer_reads(node: Node) -> list[Value]:
    return _outer_reads(node)
