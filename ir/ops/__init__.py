"""Op families; importing this package fills the registry."""

from ir.ops import (blocks, control, elementwise, indexing, nn, normalization, pooling, reduce,  # noqa: F401
                    quantized, grid_sample, linalg, ml, ml_trees, recurrent, resize, signal, spectral,
                    tensor)
from ir.ops import data_dependent  # noqa: F401
from ir.ops import contrib_attention, contrib_fused, contrib_transformer  # noqa: F401
from ir.ops import contrib_qlinear, contrib_quantized, gather_block_quantized, matmul_nbits  # noqa: F401
from ir.ops import function_bodies  # noqa: F401,E402  (last: it looks at every family's entries)
from ir.ops.function_bodies import lowering_route  # noqa: E402
from ir.ops.registry import (CONTRACTION, CONTROL, ELEMENTWISE, LAYOUT, NORMALIZATION, OTHER, RANDOM,
                             REDUCTION, REGISTRY, SHAPE, Epilogue, OpDef, bounds_of, epilogue_activations,
                             epilogue_of, is_quantized_exact, is_view, keeps_bound, kind_of, lookup, lowering, quantizes_activations,
                             node_flops, register, view_ops)

__all__ = ["REGISTRY", "Epilogue", "OpDef", "bounds_of", "keeps_bound", "epilogue_activations", "epilogue_of",
           "is_quantized_exact", "is_view", "kind_of", "lookup",
           "lowering", "lowering_route", "node_flops", "quantizes_activations", "register", "view_ops", "CONTRACTION", "CONTROL", "ELEMENTWISE", "LAYOUT",
           "NORMALIZATION", "OTHER", "RANDOM", "REDUCTION", "SHAPE"]
