"""Real models as onnxruntime's quantizer writes them, cached at `.cache/models/contrib-quantized-*.onnx`
(built with samples/contrib_models.py's helpers):

- two light models (samples/light_models.py), squeezenet and shufflenet: `quantize_dynamic`
  (ConvInteger, MatMulInteger: standard ops) and `quantize_static` in the QOperator format
  (QLinearConv and the com.microsoft QLinearConcat, QLinearGlobalAveragePool, QLinearAveragePool,
  QGemm, QLinearSoftmax), calibrated on a few inputs near the light model's own;
- MiniLM (samples/minilm.py): `quantize_dynamic` with onnxruntime's fusions of the quantizer's
  chains into DynamicQuantizeMatMul / MatMulIntegerToFloat (the transformer fusions left out but
  for com.microsoft Gelu), and `quantize_static` in the QOperator format (QLinearMatMul,
  QLinearAdd, QLinearMul, QLinearSoftmax).

Each function returns a `QuantizedModel`: the path and a feed, what a benchmark needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import version_converter

from ir.onnx_export import export_model
from ir.onnx_import import load_model
from passes import optimize_pipeline, run_pipeline
from samples.contrib_models import cached_model, fused, quantized_dynamic, quantized_static
from samples.light_models import light_model
from samples.minilm import ensure_minilm, minilm_feed

OPSET = 17
LIGHT_NAMES = ("squeezenet", "shufflenet")
MINILM_DIMS = {"batch": 1, "seq": 16}
# onnxruntime's extended-level fusions that write transformer contrib ops rather than fuse the
# quantizer's output: off, so the fused MiniLM holds the quantized MatMul fusions and, of the
# transformer ops, only com.microsoft Gelu (which ir/ops/contrib_transformer.py expands).
TRANSFORMER_FUSIONS = ("AttentionFusion", "EmbedLayerNormFusion", "SkipLayerNormFusion", "BiasGeluFusion",
                       "FastGeluFusion", "BiasSoftmaxFusion", "MatMulScaleFusion", "MatmulTransposeFusion",
                       "QuickGeluFusion")


@dataclass(frozen=True)
class QuantizedModel:
    name: str
    path: Path
    feed: dict[str, np.ndarray]
    input_shapes: dict[str, tuple[int, ...]]
    dims: dict[str, int]


def quantized_light_model(name: str, static: bool) -> QuantizedModel:
    case = light_model(name)
    form = "static" if static else "dynamic"
    if static:
        def build(folder: Path) -> Path:
            return quantized_static(_light_float_model(name, folder), folder, _light_calibration(case.inputs))
    else:
        def build(folder: Path) -> Path:
            return quantized_dynamic(_light_float_model(name, folder), folder)
    path = cached_model(f"quantized-{name}-{form}", build)
    return QuantizedModel(f"{name}-{form}", path, dict(case.inputs), dict(case.input_shapes), {})


def quantized_minilm(static: bool) -> QuantizedModel:
    form = "static" if static else "dynamic"
    if static:
        def build(folder: Path) -> Path:
            calibration = [minilm_feed(**MINILM_DIMS), minilm_feed(batch=1, seq=24)]
            return quantized_static(ensure_minilm(), folder, calibration)
    else:
        def build(folder: Path) -> Path:
            return fused(quantized_dynamic(ensure_minilm(), folder), folder, TRANSFORMER_FUSIONS)
    path = cached_model(f"quantized-minilm-{form}", build)
    return QuantizedModel(f"minilm-{form}", path, minilm_feed(**MINILM_DIMS), {}, dict(MINILM_DIMS))


def quantized_models() -> list[QuantizedModel]:
    return [*(quantized_light_model(name, static) for name in LIGHT_NAMES for static in (False, True)),
            quantized_minilm(static=False), quantized_minilm(static=True)]


def _light_float_model(name: str, folder: Path) -> Path:
    """The light model with its ConstantOfShape weights folded into initializers (the quantizer
    quantizes initializers only) and converted from opset 9 to 17 (QOperator needs 10 or more)."""
    case = light_model(name)
    graph, _ = run_pipeline(load_model(case.path), optimize_pipeline(case.input_shapes))
    path = folder / "float.onnx"
    onnx.save(version_converter.convert_version(export_model(graph), OPSET), path)
    return path


def _light_calibration(inputs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    return [{k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in inputs.items()}
            for _ in range(3)]
