"""Shapes of onnxruntime's contrib ops (domain com.microsoft), which ONNX's inference does not know.

onnxruntime ships a symbolic shape inference that covers the ops its transformer optimizer writes
(Attention, SkipLayerNormalization, EmbedLayerNormalization, FastGelu, BiasGelu, QLinearAdd...);
`infer_contrib_shapes` runs it on the graph once the inputs are bound and adopts the static dims it
finds where ONNX's inference left a value unknown. Its table lacks a few ops that onnxruntime's
quantizer and graph optimiser write; `passes.contrib_symbolic.ContribShapeInference` adds those rules.

The tool is imported on the first model with a contrib node, not with this module: importing
`onnxruntime.tools` imports torch wherever torch is installed, which took 3.3 s of every `cortex`
command's start.

The tool is a best effort: a model it cannot follow (an op neither it nor ONNX knows) only leaves
those values unknown, which `InferShapes(require_static=True)` then reports as it would anyway.
"""

from __future__ import annotations

import contextlib
import logging

import onnx

CONTRIB_DOMAIN = "com.microsoft"


def has_contrib_nodes(nodes) -> bool:
    return any(node.domain == CONTRIB_DOMAIN for node in nodes)


def infer_contrib_shapes(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The model with the value_info the tool found, or None where it cannot read the model."""
    from passes import contrib_symbolic  # deferred: see the module's docstring (not a cycle)

    with _quiet(contrib_symbolic.LOGGER):
        try:
            return contrib_symbolic.ContribShapeInference().run(model)
        except Exception:  # noqa: BLE001 - any failure of this best effort leaves ONNX's result
            return None


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    """The tool logs warnings about what it cannot follow; Cortex reports unknown shapes itself."""
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)
