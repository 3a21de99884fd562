"""Building loop nests from IR nodes.

`LoopBuilder` walks one static-shape graph (one computation unit): it gives every value a buffer
(inputs, outputs, weights, temporaries), calls each node's `loops` lowering from the op registry, and
collects the statements the lowering emits into one kernel per node. Lowerings use its small
vocabulary: `with b.loops(shape) as idx`, `b.store(y, idx, expr)`, `acc = b.local(...)`, and the
broadcasting helper `b.elementwise(node, fn)` that makes most elementwise ops one line.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

import numpy as np

from ir import dtypes
from ir.bounds import length_name
from ir.errors import UnsupportedError
from ir.graph import Graph, Node, Value
from ir.loops.contraction import ContractionKernels, ContractionOperands, ContractionSpec, is_empty
from ir.loops.expr import Expr, Local, Var, cast, lift
from ir.loops.narrow_weights import NarrowWeight, narrow_weight_chains
from ir.loops.program import (COMPUTE_TYPE, INPUT, OUTPUT, TEMP, WEIGHT, Assign, Buffer, If, Intrinsic, Kernel, Loop,
                              Program, Stmt, Storage, Store)

BACKEND = "loops"


def storage_dtype(value: Value, node: Node | None = None) -> str:
    try:
        name = dtypes.to_numpy(value.dtype).name if value.dtype else ""
    except (KeyError, ValueError, TypeError):
        name = ""
    if name not in COMPUTE_TYPE:
        where = f" in {node.describe()}" if node is not None else ""
        raise UnsupportedError(f"tensor {value.name!r}{where} has dtype {dtypes.name(value.dtype)}, "
                               "which the loop-nest backends do not support")
    return name


class LoopBuilder:
    def __init__(self, graph: Graph, kernels: ContractionKernels | None = None,
                 lowering_of: Callable[[Node], Callable | None] = lambda node: None,
                 expand: Callable[[Node, dict], Graph] | None = None, group_of: dict[int, int] | None = None):
        """`kernels`: the ready-made contraction kernels the target offers (see `Intrinsic`), None
        for none; `lowering_of(node)`: the op's registered lowering (the op registry sits above
        this IR); `expand(node, opsets)`: its ONNX function body as a static graph, for ops without
        one; `group_of`: id(node) -> its fusion group (`passes/fuse_groups.py`), see `fused`."""
        self.graph = graph
        self._group_of = dict(group_of or {})
        self._lowering_of = lowering_of
        self._expand = expand
        self._kernels = kernels
        self.program = Program()
        self._buffers: dict[int, Buffer] = {}
        self._names: set[str] = set()
        self._stack: list[list[Stmt]] = []
        self._kernel: Kernel | None = None
        # computed once: the graph does not change while it is lowered
        self.output_ids = {id(v) for v in graph.outputs}
        self.users = graph.users()
        self._readers = {id(v): nodes for v, nodes in self.users.items()}
        self._positions = {id(n): i for i, n in enumerate(graph.nodes)}
        self._shared_constants: dict = {}
        self._absorbed: set[int] = set()     # nodes another node's kernel computes (epilogues)
        # Widenings of narrow weights, held back until their reader decides (see `narrow_weight`).
        self._narrow = narrow_weight_chains(graph, self._readers, self.output_ids)
        self._held = {id(n): v for v, w in self._narrow.items() for n in w.nodes}
        self._lengths: dict[str, Buffer] = {}   # length key -> its companion (ir/bounds.py)
        for v in graph.inputs:
            if not v.is_const:
                buf = self._new_buffer(v.name, storage_dtype(v), _shape(v), INPUT)
                self._buffers[id(v)] = buf
                self.program.inputs[v.name] = buf
                if v.is_bounded:
                    companion = self._new_buffer(length_name(v.name), "int32", (1,), INPUT)
                    self._lengths[v.length_key] = companion
                    self.program.bounds[v.name] = (v.bound_axis, companion)

    # -- buffers -------------------------------------------------------------------------------
    def buffer(self, value: Value) -> Buffer:
        buf = self._buffers.get(id(value))
        if buf is None:
            if value.is_const:
                buf = self.constant(np.asarray(value.const), value.name)
            else:
                kind = OUTPUT if id(value) in self.output_ids else TEMP
                buf = self._new_buffer(value.name, storage_dtype(value), _shape(value), kind)
            self._buffers[id(value)] = buf
        return buf

    def input(self, node: Node, i: int) -> Buffer | None:
        if i >= len(node.inputs) or node.inputs[i] is None:
            return None
        return self.buffer(node.inputs[i])

    def output(self, node: Node, i: int = 0) -> Buffer:
        return self.buffer(node.outputs[i])

    @staticmethod
    def const_input(node: Node, i: int) -> np.ndarray | None:
        """The value of a constant input (axes, shapes, pads...), or None when absent."""
        if i >= len(node.inputs) or node.inputs[i] is None:
            return None
        v = node.inputs[i]
        if not v.is_const:
            raise UnsupportedError(f"{node.describe()}: input {i} ({v.name!r}) must be a constant "
                                   "for the loop-nest backends")
        return np.asarray(v.const)

    def constant(self, array: np.ndarray, name: str = "const") -> Buffer:
        array = np.asarray(array, order="C")     # not ascontiguousarray: it makes scalars 1-D
        if array.dtype.name not in COMPUTE_TYPE:
            raise UnsupportedError(f"constant {name!r} has dtype {array.dtype}, which the loop-nest "
                                   "backends do not support")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        buf = self._new_buffer(name, array.dtype.name, array.shape, WEIGHT)
        buf.storage.data = data
        return buf

    def shared_constant(self, key, make: Callable[[], np.ndarray], name: str) -> Buffer:
        """The constant `make()` builds, built once per `key` (a weight packed the same way for
        several kernels that read it)."""
        if key not in self._shared_constants:
            self._shared_constants[key] = self.constant(make(), name)
        return self._shared_constants[key]

    def length(self, value: Value) -> Buffer:
        """The length companion of a bounded value (one int32, ir/bounds.py): written by the
        data-dependent op that selects its elements, shared by every value derived from them."""
        if not value.is_bounded:
            raise ValueError(f"{value.name!r} has no data-dependent length")
        if value.length_key not in self._lengths:
            self._lengths[value.length_key] = self.temp("int32", (1,), length_name(value.name))
        return self._lengths[value.length_key]

    def temp(self, dtype: str, shape, name: str = "tmp") -> Buffer:
        return self._new_buffer(name, dtype, tuple(int(d) for d in shape), TEMP)

    def bind(self, value: Value, buffer: Buffer) -> None:
        """Let `value` (a body input of a Loop or Scan) live in `buffer`, which the lowering of its
        node fills before each iteration."""
        self._buffers[id(value)] = buffer

    def sole_reader(self, value: Value) -> Node | None:
        """The one node reading `value`, when it is also not a graph output (so a kernel may fuse
        that node in and never materialise `value`)."""
        readers = self._readers.get(id(value), [])
        return readers[0] if len(readers) == 1 and id(value) not in self.output_ids else None

    def position(self, node: Node) -> int | None:
        """`node`'s place in the graph's order (the order kernels run in); None for a node of a
        branch or a function body."""
        return self._positions.get(id(node))

    def fused(self, anchor: Node, node: Node) -> bool:
        """Whether the fusion groups put `node` with `anchor`, so that `anchor`'s kernel may absorb
        it. A node of a branch or a function body has no group: for it, the lowering's own checks
        decide alone."""
        if self.position(anchor) is None:
            return True
        group = self._group_of.get(id(anchor))
        return group is not None and group == self._group_of.get(id(node))

    def narrow_weight(self, value: Value) -> NarrowWeight | None:
        """The narrow constant `value` (a MatMul's or Gemm's B) is widened from, when it is one
        (ir/loops/narrow_weights.py). A lowering that reads it calls `read_narrow`; otherwise the
        widening runs as its own kernels just before the reader's."""
        return self._narrow.get(id(value))

    def read_narrow(self, value: Value) -> None:
        """The current kernel reads `value`'s narrow constant: its widening is never computed."""
        self._absorbed.update(id(n) for n in self._narrow.pop(id(value)).nodes)

    def absorb(self, node: Node) -> Buffer:
        """Mark `node` as computed by the current kernel (an epilogue); returns its output buffer,
        which the current kernel writes instead."""
        self._absorbed.add(id(node))
        return self.output(node)

    def alias(self, out: Value, source: Buffer) -> None:
        """Let `out` share `source`'s storage under its own shape (Reshape, Squeeze, Identity...).
        A graph output always owns its storage, so it gets a copy instead."""
        shape = _shape(out)
        if id(out) in self.output_ids:
            self.copy(self.buffer(out), source)
        else:
            self._buffers[id(out)] = source.view(shape)

    def _new_buffer(self, name: str, dtype: str, shape, kind: str) -> Buffer:
        shape = tuple(int(d) for d in shape)
        storage = Storage(self._unique(name), dtype, int(np.prod(shape, dtype=np.int64)), kind)
        self.program.storages.append(storage)
        return Buffer(storage, shape)

    def _unique(self, name: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.]", "_", name) or "t"
        candidate, n = base, 1
        while candidate in self._names:
            candidate, n = f"{base}_{n}", n + 1
        self._names.add(candidate)
        return candidate

    # -- statements ----------------------------------------------------------------------------
    def emit(self, stmt: Stmt) -> None:
        self._stack[-1].append(stmt)

    @contextlib.contextmanager
    def loop(self, extent: int, name: str = "i"):
        var = Var(name)
        loop = Loop(var, int(extent))
        self.emit(loop)
        self._stack.append(loop.body)
        try:
            yield var
        finally:
            self._stack.pop()

    @contextlib.contextmanager
    def loops(self, shape, name: str = "i"):
        """A perfect nest over `shape` (outermost first); yields the index vars."""
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(self.loop(d, f"{name}{k}")) for k, d in enumerate(shape)]

    @contextlib.contextmanager
    def when(self, cond: Expr):
        stmt = If(cond)
        self.emit(stmt)
        self._stack.append(stmt.body)
        try:
            yield
        finally:
            self._stack.pop()

    # -- ready-made contraction kernels (ir/loops/contraction.py) -------------------------------
    def offers(self, spec: ContractionSpec) -> bool:
        """Whether the target has a kernel for `spec`."""
        return self._kernels is not None and not is_empty(spec) and self._kernels.offers(spec)

    def contraction_weight(self, spec: ContractionSpec, weight: Value,
                           values: np.ndarray | NarrowWeight | None = None) -> Buffer:
        """The weight of `spec` as the target's kernel reads it: `weight`'s buffer, or, where the
        target repacks a constant weight, the packed constant (of `values`, default the weight's own;
        a `NarrowWeight` for a spec that reads B narrow)."""
        layout = self._kernels.weight_layout(spec)
        if layout is None:
            return self.buffer(weight)
        source = np.asarray(weight.const) if values is None else values
        name = weight.name + layout.suffix
        if layout.shared:   # packed once per weight and layout
            return self.shared_constant((id(weight), layout.suffix),
                                        lambda: self._kernels.pack_weight(spec, source), name)
        return self.constant(self._kernels.pack_weight(spec, source), name)

    def call_contraction(self, spec: ContractionSpec, operands: ContractionOperands, a_name: str, b_name: str) -> None:
        """Emit the target's kernel for `spec` over `operands`, with the scratch it asks for (named
        after `a_name` or `b_name`, the operand each belongs to)."""
        names = {"a": a_name, "b": b_name}
        operands.scratch = tuple(self.temp("float32", (s.elements,), names[s.of] + s.suffix)
                                 for s in self._kernels.scratch(spec))
        self.emit(Intrinsic(spec, operands))

    def store(self, buf: Buffer, index, value) -> None:
        if not isinstance(index, (list, tuple)):
            index = (index,)
        self.emit(Store(buf, buf.flat_index(index), cast(lift(value, buf.compute_type), buf.compute_type)))

    def store_flat(self, buf: Buffer, flat, value) -> None:
        self.emit(Store(buf, lift(flat, "i32"), cast(lift(value, buf.compute_type), buf.compute_type)))

    def local(self, type: str, init, name: str = "acc") -> Local:
        loc = Local(name, type)
        self._kernel.locals.append(loc)
        self.assign(loc, init)
        return loc

    def assign(self, loc: Local, value) -> None:
        self.emit(Assign(loc, cast(lift(value, loc.type), loc.type)))

    # -- common shapes of computation ----------------------------------------------------------
    def elementwise(self, node: Node, fn, out: int = 0, inputs=None) -> None:
        """out = fn(*inputs) with numpy broadcasting; missing optional inputs, and those not
        listed in `inputs` (indices, default all), are passed as None."""
        y = self.output(node, out)
        ins = [self.input(node, i) if inputs is None or i in inputs else None for i in range(len(node.inputs))]
        shape, views = collapse_broadcast(y.shape, [x.shape if x is not None else None for x in ins])
        y = y.view(shape)
        ins = [x.view(v) if x is not None else None for x, v in zip(ins, views)]
        with self.loops(y.shape) as idx:
            args = [broadcast_load(x, y.shape, idx) if x is not None else None for x in ins]
            self.store(y, idx, fn(*args))

    def copy(self, dst: Buffer, src: Buffer) -> None:
        """Flat copy between buffers of the same element count (the storage order is shared)."""
        with self.loop(dst.numel) as i:
            self.store_flat(dst, i, src.at(i))

    def fill(self, dst: Buffer, value) -> None:
        with self.loop(dst.numel) as i:
            self.store_flat(dst, i, value)

    # -- driving -------------------------------------------------------------------------------
    def lower(self, node: Node) -> None:
        if id(node) in self._absorbed or id(node) in self._held:
            return
        at = len(self.program.kernels)
        self.program.kernels.append(self._lower_kernel(node))
        # A widening its reader did not read narrow runs just before the reader, in order.
        widenings = [self._narrow.pop(id(v)) for v in node.inputs if v is not None and id(v) in self._narrow]
        self.program.kernels[at:at] = [self._lower_kernel(n) for w in widenings for n in w.nodes]

    def _lower_kernel(self, node: Node) -> Kernel:
        self._kernel = Kernel(self._unique(f"{node.op_type}_{node.name or 'node'}"), node.op_type)
        self._stack = [self._kernel.body]
        self.lower_inline(node)
        kernel, self._kernel = self._kernel, None
        return kernel

    def lower_inline(self, node: Node) -> None:
        """Lower `node` into the statements being built (a kernel, a branch of an If)."""
        fn = self._lowering_of(node)
        if fn is not None:
            fn(self, node)
        else:
            self.lower_function_body(node)

    def lower_function_body(self, node: Node) -> None:
        """An op without a lowering of its own, through its ONNX function body (see functions.py)."""
        if self._expand is None:
            raise UnsupportedError(f"{node.op_type} ({node.name}) has no loop-nest lowering")
        body = self._expand(node, self.graph.opset_imports)
        outer = {v.name: v for v in node.inputs if v is not None}
        for v in body.inputs:
            self._buffers[id(v)] = self.buffer(outer[v.name])
        produced = {id(out) for inner in body.nodes for out in inner.outputs}
        pairs = list(zip(wanted_outputs(node), body.outputs))
        for j, v in pairs:
            if id(v) in produced and id(v) not in self._buffers:
                self._buffers[id(v)] = self.output(node, j)
        for inner in body.nodes:
            self.lower_inline(inner)
        for j, v in pairs:
            if self.buffer(v).storage is not self.output(node, j).storage:
                self.copy(self.output(node, j), self.buffer(v))

    @contextlib.contextmanager
    def branches(self, cond: Expr):
        """`with b.branches(c) as (then, orelse):` then `with then:` ... `with orelse:` ..."""
        stmt = If(cond)
        self.emit(stmt)

        @contextlib.contextmanager
        def into(body):
            self._stack.append(body)
            try:
                yield
            finally:
                self._stack.pop()
        yield into(stmt.body), into(stmt.orelse)

    def finish(self) -> Program:
        """Bind graph outputs; an output that is an input or a constant is copied into its own storage."""
        for v in self.graph.outputs:
            buf = self._buffers.get(id(v))
            if buf is None or buf.storage.kind != OUTPUT:
                dst = self._new_buffer(v.name, storage_dtype(v), _shape(v), OUTPUT)
                self._kernel = Kernel(self._unique(f"output_{v.name}"), "Identity")
                self._stack = [self._kernel.body]
                self.copy(dst, buf if buf is not None else self.buffer(v))
                self.program.kernels.append(self._kernel)
                buf = dst
            self.program.outputs[v.name] = buf
        for v in self.graph.outputs:
            if v.is_bounded:
                companion = self._new_buffer(length_name(v.name), "int32", (1,), OUTPUT)
                self._kernel = Kernel(self._unique(f"length_{v.name}"), "Identity")
                self._stack = [self._kernel.body]
                self.copy(companion, self.length(v))
                self.program.kernels.append(self._kernel)
                self.program.bounds[v.name] = (v.bound_axis, companion)
        return self.program


def wanted_outputs(node: Node) -> list[int]:
    """The outputs the model asked for (an omitted optional output has no type)."""
    return [j for j, v in enumerate(node.outputs) if v.dtype]


def broadcast_load(buf: Buffer, out_shape, idx) -> Expr:
    """Load `buf` at the position of `idx` under numpy broadcasting to `out_shape`."""
    offset = len(out_shape) - len(buf.shape)
    index = [0 if d == 1 else idx[offset + k] for k, d in enumerate(buf.shape)]
    return buf[tuple(index)] if index else buf.at(0)


def collapse_broadcast(out_shape, in_shapes):
    """Merge neighbouring dims that every input either has in full or broadcasts, so an
    elementwise nest has as few (and as long, hence vectorisable) loops as possible. Returns the
    collapsed output shape and each input's collapsed shape (None stays None)."""
    rank = len(out_shape)
    padded = [None if s is None else (1,) * (rank - len(s)) + tuple(s) for s in in_shapes]
    groups: list[list[int]] = []
    pattern: list = []
    for k, d in enumerate(out_shape):
        mine = [None if s is None or d == 1 else (s[k] == d) for s in padded]
        if groups and all(a is None or b is None or a == b for a, b in zip(pattern, mine)):
            groups[-1].append(k)
            pattern = [a if a is not None else b for a, b in zip(pattern, mine)]
        else:
            groups.append([k])
            pattern = mine
    shape = tuple(int(np.prod([out_shape[k] for k in g], dtype=np.int64)) for g in groups)
    views = [None if s is None else tuple(int(np.prod([s[k] for k in g], dtype=np.int64)) for g in groups)
             for s in padded]
    return shape, views


def _shape(value: Value) -> tuple[int, ...]:
    if not value.is_static:
        raise UnsupportedError(f"tensor {value.name!r} has no static shape ({value.shape}); bind the "
                               "inputs with --input-shape before compiling")
    return tuple(int(d) for d in value.shape)
