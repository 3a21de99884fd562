"""Control flow and sequence/optional ops: carried through, lowered only where a backend can."""

from ir.ops.registry import CONTROL, register

register("If", "Loop", "Scan", "SequenceConstruct", "SequenceEmpty", "SequenceAt", "SequenceInsert",
         "SequenceErase", "SequenceLength", "SplitToSequence", "ConcatFromSequence", "SequenceMap",
         "Optional", "OptionalGetElement", "OptionalHasElement", kind=CONTROL)


# -- lowerings to loop nests ---------------------------------------------------------------------

from ir.errors import UnsupportedError  # noqa: E402
from ir.loops.expr import ne  # noqa: E402
from ir.ops.registry import lowering  # noqa: E402


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
