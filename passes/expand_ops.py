"""Replace each node whose op the registry defines by an expansion with that expansion's nodes.

onnxruntime's quantizer and transformer optimizer write fused contrib ops (Attention,
SkipLayerNormalization, DynamicQuantizeMatMul, QLinearAdd...). Each is registered with an ONNX
function body over standard ops (`ir/ops/contrib_*.py`); this pass inlines those bodies first,
before shape inference, so that everything after it (constant folding, fusion, the size limits and
weight splitting of partitioning, every backend's kernels) sees only ops it knows, and the fused
op's weights split like any MatMul's. An expansion may produce nodes that expand again. One that
needs its inputs' ranks (FusedMatMul's transposes, in a model onnxruntime saved optimised, where
value_info is gone) raises NeedsShapes and waits: shape inference expands it once they are known.
One whose node has a form it does not cover (string labels, a transform it does not implement)
raises NotExpanded: the node stays as it is, for a fallback CU to run.

The body's nodes read the node's own input values (a weight stays one constant, shared) and write
its output values (names, and with them the graph's interface, are kept); the values between them
get fresh names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ir.errors import NeedsShapes, NotExpanded, UnsupportedError
from ir.function_call import inline_body
from ir.graph import Graph, Node, Value
from ir.ops import lookup
from ir.ops.body_opset import body_opset, read_at_opset
from passes.base import Pass, rewrite_nodes

MAX_ROUNDS = 8      # expansions that produce expandable ops; none nests deeper than two


@dataclass
class ExpandOps(Pass):
    name = "expand-ops"

    def run(self, graph: Graph) -> Graph:
        expand_ops(graph)
        return graph


def expand_ops(graph: Graph) -> int:
    """Expand every node that can be (an expansion that needs shapes not known yet raises
    NeedsShapes: that node waits, and infer-shapes calls this again each round); returns how many
    nodes were expanded."""
    expanded = 0
    for _ in range(MAX_ROUNDS):
        count = _expand_once(graph, graph)
        if not count:
            break
        expanded += count
    return expanded


def waiting_expansion(graph: Graph) -> NeedsShapes | None:
    """Why the first node still waiting for shapes cannot expand, or None when none waits."""
    for node in graph.walk():
        if expandable(node):
            try:
                lookup(node.op_type, node.domain).expansion(node)
            except NeedsShapes as why:
                return why
            except NotExpanded:
                continue
    return None


def declined_because(node: Node) -> str | None:
    """Why the node's expansion declined its form (NotExpanded), without the node's own name; None
    when its op has no expansion or the expansion takes it."""
    if not expandable(node):
        return None
    try:
        lookup(node.op_type, node.domain).expansion(node)
    except NotExpanded as why:
        return str(why).removeprefix(node.describe() + ": ")
    except UnsupportedError:
        return None
    return None


def expandable(node: Node) -> bool:
    entry = lookup(node.op_type, node.domain)
    return entry is not None and entry.expansion is not None


def _expand_once(graph: Graph, model: Graph) -> int:
    inside = sum(_expand_once(sub, model) for node in graph.nodes for sub in node.subgraphs)
    return inside + rewrite_nodes(graph, lambda node: _expanded(node, model))


def _expanded(node: Node, model: Graph) -> list[Node] | None:
    """The nodes of `node`'s expansion; None when it has none, or when it waits for shapes."""
    if not expandable(node):
        return None
    try:
        return _expansion(node, model)
    except (NeedsShapes, NotExpanded):
        return None


def _at_model_opset(node: Node, function, opset_imports: dict[str, int]):
    """The body read at the model's default opset (ir/ops/body_opset.py rewrites the nodes whose
    ops changed their signature since an older one), which becomes the body's own where the model
    imports none."""
    model = opset_imports.get("", opset_imports.get("ai.onnx"))
    if model is None:
        # A model of ai.onnx.ml ops alone may import no default opset: the body's own joins it.
        model = opset_imports[""] = body_opset(function)
    return function if model is None else read_at_opset(function, model, node.describe())


def _expansion(node: Node, model: Graph) -> list[Node]:
    function = _at_model_opset(node, lookup(node.op_type, node.domain).expansion(node), model.opset_imports)
    wanted = [j for j, out in enumerate(node.outputs) if out.name]
    body = inline_body(node, function, model.opset_imports, wanted, constants_inside=False)
    by_name = {v.name: v for v in node.inputs if v is not None}
    renamed: dict[int, Value] = {id(v): by_name[v.name] for v in body.inputs}
    forwarded: list[tuple[Value, Value]] = []   # a body output that is an input or a constant
    for j, v in zip(wanted, body.outputs):
        if id(v) in renamed or v.producer is None:
            forwarded.append((renamed.get(id(v), v), node.outputs[j]))
        else:
            renamed[id(v)] = node.outputs[j]
    prefix = node.name or node.op_type
    for inner in body.walk():
        inner.name = model.fresh_name(f"{prefix}/{inner.name or inner.op_type}")
        for v in [*inner.inputs, *inner.outputs]:
            if v is not None and id(v) not in renamed:
                renamed[id(v)] = v
                v.name = model.fresh_name(f"{prefix}/{v.name}")
        inner.inputs = [renamed[id(v)] if v is not None else None for v in inner.inputs]
        inner.outputs = [renamed[id(v)] for v in inner.outputs]
        for out in inner.outputs:
            out.producer = inner
    nodes = list(body.nodes)
    for j, (source, target) in enumerate(forwarded):
        nodes.append(Node("Identity", [source], [target], name=model.fresh_name(f"{prefix}/forward_{j}")))
    return nodes
