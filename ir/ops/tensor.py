"""Layout ops (data movement without arithmetic) and shape computations."""

from ir.ops.registry import LAYOUT, SHAPE, register

register("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split", "Slice",
         "Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "Scatter", "Expand",
         "Tile", "Pad", "DepthToSpace", "SpaceToDepth", "ReverseSequence", "ConstantOfShape",
         kind=LAYOUT)
register("Shape", "Size", kind=SHAPE)
