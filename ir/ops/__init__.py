"""Op families; importing this package fills the registry."""

from ir.ops import (control, elementwise, indexing, nn, normalization, pooling, reduce,  # noqa: F401
                    grid_sample, linalg, recurrent, resize, spectral, tensor)
from ir.ops import contrib_attention, contrib_transformer  # noqa: F401
from ir.ops import function_bodies  # noqa: F401,E402  (last: it looks at every family's entries)
from ir.ops.registry import (CONTRACTION, CONTROL, ELEMENTWISE, LAYOUT, NORMALIZATION, OTHER, RANDOM,
                             REDUCTION, REGISTRY, SHAPE, Epilogue, OpDef, epilogue_activations, epilogue_of,
                             is_view, kind_of, lookup, lowering, node_flops, register, view_ops)

__all__ = ["REGISTRY", "Epilogue", "OpDef", "epilogue_activations", "epilogue_of", "is_view", "kind_of", "lookup",
           "lowering", "node_flops", "register", "view_ops", "CONTRACTION", "CONTROL", "ELEMENTWISE", "LAYOUT",
           "NORMALIZATION", "OTHER", "RANDOM", "REDUCTION", "SHAPE"]
