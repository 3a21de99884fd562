"""Layout ops (data movement without arithmetic) and shape computations."""

from ir.ops.registry import LAYOUT, SHAPE, register

register("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split", "Slice",
         "GatherElements", "GatherND", "ScatterElements", "ScatterND", "Scatter", "Expand",
         "Tile", "Pad", "DepthToSpace", "SpaceToDepth", "ReverseSequence", "ConstantOfShape",
         kind=LAYOUT)
register("Shape", "Size", kind=SHAPE)


def _gather_table_axis(node):
    """An embedding lookup (Gather on a table's leading axes) splits along the table's last axis,
    which is also the output's last axis; gathering along the last axis itself cannot split so."""
    table = node.inputs[0]
    rank = len(table.shape) if table is not None and table.shape is not None else 0
    axis = node.attrs.get("axis", 0)
    return -1 if rank >= 2 and (axis % rank) != rank - 1 else None


register("Gather", kind=LAYOUT, weight_input=0, weight_axis=_gather_table_axis,
         output_axis=_gather_table_axis)
