"""Work that depends only on inputs that repeat between calls (`decompose --cache-inputs`).

An encoder-decoder's decoder is called once per generated token with the same encoder memory:
the cross-attention key and value projections of the memory give the same result every call. If
the partitioner keeps such work in CUs of its own, apart from work that reads the inputs that
change, the runtime's result cache can answer those CUs from earlier calls. This module says which
nodes are such work: their results depend only on the named inputs and on constants. Random ops
never are (a CU holding one is never cached), and neither is anything reading them.
"""

from __future__ import annotations

from ir.errors import CortexError
from ir.graph import Graph, outer_reads
from ir.ops.registry import RANDOM, kind_of


def parse_names(text: str) -> tuple[str, ...]:
    """`--cache-inputs NAME,...` as a tuple of names (empty text: none)."""
    names = tuple(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    if str(text).strip() and not names:
        raise CortexError(f"--cache-inputs {text!r}: expected model input names separated by commas")
    return names


def show_names(names) -> str:
    return ",".join(names)


def check_names(graph: Graph, names: tuple[str, ...]) -> None:
    inputs = [v.name for v in graph.inputs]
    for name in names:
        if name not in inputs:
            known = ", ".join(map(repr, inputs)) or "none"
            raise CortexError(f"--cache-inputs {name!r} is not an input of the model (its inputs: {known})")


def repeating_nodes(graph: Graph, names: tuple[str, ...]) -> set[int]:
    """Ids of the nodes of `graph` (topologically sorted) whose results depend only on the inputs
    `names` and on constants."""
    changing_inputs = {id(v) for v in graph.inputs if v.name not in names}
    changing: set[int] = set(changing_inputs)      # ids of values that may differ between calls
    repeating: set[int] = set()
    for node in graph.nodes:
        reads = [*node.present_inputs, *outer_reads(node)]
        if kind_of(node.op_type, node.domain) == RANDOM or any(id(v) in changing for v in reads):
            changing.update(id(o) for o in node.outputs)
        else:
            repeating.add(id(node))
    return repeating


def cut_mixed_groups(graph: Graph, repeating: set[int]) -> int:
    """A fusion group is one atom the partitioner never cuts, but a group whose anchor reads only
    repeating inputs may close over an elementwise node that reads a changing one (a mask term
    added to the attention scores). Such a group loses its repeating members, which become a group
    of their own (the lowering recomputes fusion inside each CU, so only cross-CU fusion is lost).
    A repeating node never depends on a changing one, so both parts stay convex. Returns the
    number of groups cut."""
    groups: dict[str, list] = {}
    for node in graph.nodes:
        if node.fusion_group is not None:
            groups.setdefault(node.fusion_group, []).append(node)
    cut = 0
    for name, members in groups.items():
        kept = [n for n in members if id(n) in repeating]
        if not kept or len(kept) == len(members):
            continue
        cut += 1
        for node in kept:
            node.fusion_group = f"{name}_repeating" if len(kept) > 1 else None
        rest = [n for n in members if id(n) not in repeating]
        if len(rest) == 1:
            rest[0].fusion_group = None
    return cut
