"""The residual add a GEMM or Conv kernel does in its epilogue, the one rule both the fusion groups
(`passes.fuse_groups`) and the kernels' lowering (`_fused_epilogue` in `nn`) go by: an op the
registry marks as a residual epilogue (an Add, or a Sum of two, as older exporters write resnet's
shortcut) of the product so far and a non-constant tensor of exactly its shape and dtype. No
broadcast: the kernel reads the residual at the position of each output it writes."""

from ir.ops.registry import epilogue_of


def residual_operand(node, is_product):
    """The operand `node` adds to the product when it is such a residual add, else None.
    `is_product(value)` says whether a value is the product so far; exactly one operand must be."""
    epilogue = epilogue_of(node)
    if epilogue is None or not epilogue.residual or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return None
    a, b = node.inputs
    if is_product(a) == is_product(b):
        return None
    inner, outer = (a, b) if is_product(a) else (b, a)
    if outer.is_const or outer.dtype != inner.dtype or inner.shape is None:
        return None
    if not tuple(outer.shape or ()) == tuple(inner.shape) == tuple(node.outputs[0].shape or ()):
        return None
    return outer
