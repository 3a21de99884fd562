"""Registered ops without a lowering of their own but with an ONNX function body (Celu, Range,
the window functions, CenterCropPad...) lower through that body, so the registry says truthfully
what the loop-nest backends can compile. Imported after every op family."""

import onnx

from ir.ops.registry import REGISTRY, lookup, lowering

BACKEND = "loops"


def _lower_through_function_body(b, node):
    b.lower_function_body(node)


def _has_function_body(op_type: str, domain: str) -> bool:
    # Asked first rather than caught: importing the registry must throw no C++ exception (the
    # contrib ops have no ONNX schema), which a process under AddressSanitizer cannot unwind.
    if not onnx.defs.has(op_type, domain):
        return False
    schema = onnx.defs.get_schema(op_type, domain=domain)
    return bool(schema.has_function or schema.has_context_dependent_function)


for (_domain, _op), _entry in sorted(REGISTRY.items()):
    if BACKEND not in _entry.lowerings and _has_function_body(_op, _domain):
        lowering(BACKEND, _op, domain=_domain)(_lower_through_function_body)


def lowering_route(op_type: str, domain: str, backend: str) -> str:
    """How a backend's lowerings compute the op: "kernel" (a lowering of its own), "function body"
    (ONNX's body for it, lowered op by op), "expansion" (replaced before shape inference by other
    ops, see passes/expand_ops.py) or "none"."""
    entry = lookup(op_type, domain)
    if entry is None:
        return "none"
    if entry.expansion is not None:
        return "expansion"
    fn = entry.lowerings.get(backend)
    if fn is None:
        return "none"
    return "function body" if fn is _lower_through_function_body else "kernel"
