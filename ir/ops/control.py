"""Control flow and sequence/optional ops: carried through, lowered only where a backend can.

If compiles both branches and picks one at run time. Loop and Scan compile to one loop of the
loop-nest IR around their body, whose shapes must be static and the same every iteration: the
body's inputs live in buffers the loop fills before each iteration (the iteration number, the
condition, the carried state, one slice of each scan input), and after the body its results are
copied back (scan outputs into their row, then the carried state). A Loop whose trip count is only
bounded (M computed at run time, a condition the body computes) guards each iteration with the
run-time test; a scan output keeps the length the model gives it, and rows of iterations that did
not run are zero.
"""

from ir.graph import Graph, Node
from ir.ops.registry import CONTROL, register
from ir.subgraphs import loop_trips


def _loop_shapes(node: Node, opset: int) -> list:
    """ONNX leaves a Loop's carried state without a shape (it could change every iteration) and
    its scan outputs without a length: a state the body keeps keeps its shape, and a loop with a
    static trip count stacks that many rows."""
    body: Graph = node.attrs["body"]
    carried = len(node.inputs) - 2
    found = []
    for j in range(carried):
        initial, result = node.inputs[2 + j], body.outputs[1 + j]
        keeps = initial is not None and initial.is_static and result.is_static and tuple(result.shape) == tuple(initial.shape)
        found.append((initial.dtype, tuple(initial.shape)) if keeps else None)
    count = loop_trips(node).count
    for v in body.outputs[1 + carried:]:
        found.append((v.dtype, (count, *v.shape)) if count is not None and v.is_static else None)
    return found


register("If", "Scan", "SequenceConstruct", "SequenceEmpty", "SequenceAt", "SequenceInsert",
         "SequenceErase", "SequenceLength", "SplitToSequence", "ConcatFromSequence", "SequenceMap",
         "Optional", "OptionalGetElement", "OptionalHasElement", kind=CONTROL)
register("Loop", kind=CONTROL, shape_rule=_loop_shapes)


# -- lowerings to loop nests ---------------------------------------------------------------------

from ir.errors import UnsupportedError  # noqa: E402
from ir.loops.builder import storage_dtype  # noqa: E402
from ir.loops.expr import cast, logical_and, lt, ne  # noqa: E402
from ir.ops.registry import lowering  # noqa: E402
from ir.subgraphs import scan_layout, scan_length  # noqa: E402


@lowering("loops", "If")
def _if(b, node):
    """Both branches are compiled; the condition picks one at run time. Each branch writes the If's
    outputs, so they must have the same static shapes in both."""
    cond = b.input(node, 0)
    outputs = [b.output(node, i) for i in range(len(node.outputs))]
    branches = (node.attrs["then_branch"], node.attrs["else_branch"])
    for graph in branches:
        for out, v in zip(outputs, graph.outputs):
            if not v.is_static or tuple(v.shape) != out.shape:
                raise UnsupportedError(f"{node.describe()}: branch output {v.name!r} has shape {v.shape}, "
                                       f"the If output has {list(out.shape)}; only same-shape branches compile")
    with b.branches(ne(cond.at(0), 0)) as (then, orelse):
        for body, graph in zip((then, orelse), branches):
            with body:
                for inner in graph.nodes:
                    b.lower_inline(inner)
                for out, v in zip(outputs, graph.outputs):
                    b.copy(out, b.buffer(v))


@lowering("loops", "Loop")
def _loop(b, node):
    body: Graph = node.attrs["body"]
    carried = len(node.inputs) - 2
    trips = loop_trips(node)
    if trips.bound is None:
        raise UnsupportedError(f"{node.describe()}: its trip count is not a constant after folding and no scan "
                               "output bounds it; only loops with a constant (or bounded) trip count compile")
    _check_static_body(node, body, body.inputs[2:], body.outputs[1:1 + carried])
    extent = trips.count if trips.count is not None else trips.bound
    scans = []
    for out, v in zip(node.outputs[carried:], body.outputs[1 + carried:]):
        if out.dtype and tuple(out.shape) != (extent, *v.shape):
            raise UnsupportedError(f"{node.describe()}: scan output {out.name!r} has shape {list(out.shape)}, but "
                                   f"{extent} iterations of {list(v.shape)} make {[extent, *v.shape]}")
        scans.append((b.buffer(out) if out.dtype else None, v))
    states = _state_buffers(b, node.outputs[:carried], body.inputs[2:])
    for state, initial in zip(states, node.inputs[2:]):
        b.copy(state, b.buffer(initial))
    iteration = b.temp("int64", (), "iteration")
    cond = b.temp("bool", (), "cond")
    b.store_flat(cond, 0, b.input(node, 1).at(0) if b.input(node, 1) is not None else 1)
    b.bind(body.inputs[0], iteration)
    b.bind(body.inputs[1], cond)
    for inner, state in zip(body.inputs[2:], states):
        b.bind(inner, state)
    if trips.stops_early:
        for out, _ in scans:       # the rows of iterations that do not run
            if out is not None:
                b.fill(out, 0)
    limit = node.inputs[0]
    with b.loop(extent, "trip") as t:
        running = ne(cond.at(0), 0)
        if limit is not None and not limit.is_const:
            running = logical_and(running, lt(cast(t, "i64"), b.buffer(limit).at(0)))
        with (b.when(running) if trips.stops_early else _nothing()):
            b.store_flat(iteration, 0, t)
            _lower_body(b, body)
            for out, v in scans:
                if out is None:
                    continue
                src = b.buffer(v)
                with b.loop(src.numel, "j") as j:
                    b.store_flat(out, t * src.numel + j, src.at(j))
            _carry(b, [cond, *states], body.outputs[:1 + carried])


@lowering("loops", "Scan")
def _scan(b, node):
    body: Graph = node.attrs["body"]
    layout = scan_layout(node, b.graph.opset_imports.get("", 21))
    length = scan_length(node, layout) if layout is not None else None
    if length is None:
        raise UnsupportedError(f"{node.describe()}: its scan inputs have no common static length along their scan axes")
    if layout.batched and node.inputs[0] is not None:
        lens = node.inputs[0]
        if not lens.is_const or any(int(x) != length for x in lens.const.reshape(-1)):
            raise UnsupportedError(f"{node.describe()}: sequence_lens must be a constant equal to the scan length {length}")
    n = layout.states
    _check_static_body(node, body, body.inputs[:n], body.outputs[:n])
    finals = [b.output(node, j) for j in range(n)]
    if layout.batched:
        states = [b.temp(storage_dtype(v), v.shape, "state") for v in body.inputs[:n]]
    else:
        states = _state_buffers(b, node.outputs[:n], body.inputs[:n])
    slices = [b.temp(storage_dtype(v), v.shape, "slice") for v in body.inputs[n:]]
    for inner, buf in zip(body.inputs, states + slices):
        b.bind(inner, buf)
    initials = [b.buffer(v) for v in layout.state_inputs(node)]
    scanned = [b.buffer(v) for v in layout.scanned_inputs(node)]
    outputs = [b.output(node, n + k) for k in range(len(node.outputs) - n)]
    batches = scanned[0].shape[0] if layout.batched else 1
    for out, v, axis in zip(outputs, body.outputs[n:], layout.output_axes):
        expected = list(v.shape)
        expected.insert(axis - 1 if layout.batched else axis, length)
        expected = [batches, *expected] if layout.batched else expected
        if list(out.shape) != expected:
            raise UnsupportedError(f"{node.describe()}: scan output {out.name!r} has shape {list(out.shape)}, but "
                                   f"{length} iterations of {list(v.shape)} along axis {axis} make {expected}")
    with (b.loop(batches, "batch") if layout.batched else _nothing()) as batch:
        fixed_batch = {0: batch} if layout.batched else {}
        for state, initial in zip(states, initials):
            _gather(b, state, initial, fixed_batch)
        with b.loop(length, "step") as t:
            def position(reverse):
                return (length - 1) - t if reverse else t
            for buf, outer, axis, reverse in zip(slices, scanned, layout.input_axes, layout.input_directions):
                _gather(b, buf, outer, {**fixed_batch, axis: position(reverse)})
            _lower_body(b, body)
            for out, v, axis, reverse in zip(outputs, body.outputs[n:], layout.output_axes, layout.output_directions):
                _scatter(b, out, b.buffer(v), {**fixed_batch, axis: position(reverse)})
            _carry(b, states, body.outputs[:n])
        if layout.batched:
            for final, state in zip(finals, states):
                _scatter(b, final, state, fixed_batch)
        else:
            for final, state in zip(finals, states):
                if final.storage is not state.storage:
                    b.copy(final, state)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _check_static_body(node, body: Graph, carried_in, carried_out) -> None:
    for v in body.values():
        if v.is_tensor and not v.is_const and not v.is_static:
            shape = "unknown rank" if v.shape is None else list(v.shape)
            raise UnsupportedError(f"{node.describe()}: body value {v.name!r} has no static shape ({shape}); "
                                   "only bodies with static shapes compile")
        if not v.is_tensor:
            raise UnsupportedError(f"{node.describe()}: body value {v.name!r} is not a tensor")
    for inner, result in zip(carried_in, carried_out):
        if tuple(result.shape) != tuple(inner.shape):
            raise UnsupportedError(f"{node.describe()}: its body changes the shape of loop-carried {inner.name!r} "
                                   f"from {list(inner.shape)} to {list(result.shape)}; only bodies whose shapes stay "
                                   "the same every iteration compile")


def _state_buffers(b, outputs, body_inputs):
    """The carried state lives in the node's own outputs (the final value is the last state); an
    output the model does not read gets a temporary."""
    return [b.buffer(out) if out.dtype else b.temp(storage_dtype(inner), inner.shape, "state")
            for out, inner in zip(outputs, body_inputs)]


def _lower_body(b, body: Graph) -> None:
    for inner in body.nodes:
        b.lower_inline(inner)


def _carry(b, states, results) -> None:
    """Each iteration's results become the next one's state. A result may be a view of another
    state (a body that swaps two): then all go through temporaries first."""
    pairs = [(state, b.buffer(v)) for state, v in zip(states, results)]
    pairs = [(state, src) for state, src in pairs if src.storage is not state.storage]
    written = {id(state.storage) for state, _ in pairs}
    if any(id(src.storage) in written for _, src in pairs):
        staged = []
        for state, src in pairs:
            temp = b.temp(src.dtype, src.shape, "carried")
            b.copy(temp, src)
            staged.append((state, temp))
        pairs = staged
    for state, src in pairs:
        b.copy(state, src)


def _outer_index(idx, fixed: dict, rank: int):
    rest = iter(idx)
    return tuple(fixed[a] if a in fixed else next(rest) for a in range(rank))


def _gather(b, dst, outer, fixed: dict) -> None:
    """dst = outer with the axes of `fixed` taken at the given positions."""
    if not fixed:
        b.copy(dst, outer)
        return
    with b.loops(dst.shape, "s") as idx:
        b.store(dst, idx, outer[_outer_index(idx, fixed, len(outer.shape))])


def _scatter(b, outer, src, fixed: dict) -> None:
    """outer at the positions of `fixed` = src."""
    with b.loops(src.shape, "s") as idx:
        b.store(outer, _outer_index(idx, fixed, len(outer.shape)), src[tuple(idx)] if idx else src.at(0))
