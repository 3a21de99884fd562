"""QDQ-format models: onnxruntime's `quantize_static` with `QuantFormat.QDQ`, per tensor and per
channel, cached at `.cache/models/qdq-*.onnx`:

- the small Conv/Gemm/MatMul net of `samples/contrib_models.py` (its QOperator twin is there);
- squeezenet from the onnx wheel's light models (`samples/light_models.py`);
- MiniLM (`samples/minilm.py`) with only its MatMuls quantized.

Each sample comes with a feed and with onnxruntime's output for it on the QDQ file (all graph
optimisations on, which is how onnxruntime itself runs such a model: its QDQ transformers fold the
DequantizeLinear/QuantizeLinear pairs into integer kernels), so tests and benchmarks share them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from samples.cache import SampleModel
from samples.contrib_models import (_cached, _qoperator_float_model, _save, calibration_reader,
                                    qoperator_calibration_feeds)
from samples.light_models import light_model
from samples.minilm import ensure_minilm, minilm_feed


def qdq_net(per_channel: bool = False) -> SampleModel:
    name = _name("net", per_channel)
    path = _cached(name, lambda d: _quantized(_save(_qoperator_float_model(), d, "float.onnx"), d,
                                              qoperator_calibration_feeds(), per_channel), prefix="qdq")
    x = np.random.default_rng(7).standard_normal((1, 3, 12, 12)).astype(np.float32)
    return _sample(name, path, {"x": x}, {"x": (1, 3, 12, 12)})


def qdq_squeezenet(per_channel: bool = False) -> SampleModel:
    float_model = light_model("squeezenet")
    (input_name, x), = float_model.inputs.items()
    name = _name("squeezenet", per_channel)
    rng = np.random.default_rng(3)
    feeds = [{input_name: x}] + [{input_name: rng.uniform(0, 1, x.shape).astype(np.float32)} for _ in range(2)]
    path = _cached(name, lambda d: _quantized(float_model.path, d, feeds, per_channel), prefix="qdq")
    return _sample(name, path, {input_name: x}, float_model.input_shapes)


def qdq_minilm(per_channel: bool = False, batch: int = 1, seq: int = 16) -> SampleModel:
    """Only the MatMuls quantized (activations uint8, weights int8), the usual recipe for BERT."""
    name = _name("minilm-matmul", per_channel)
    feeds = [minilm_feed(1, 16), minilm_feed(1, 32), minilm_feed(2, 16)]
    path = _cached(name, lambda d: _quantized(ensure_minilm(), d, feeds, per_channel, ["MatMul"]), prefix="qdq")
    feed = minilm_feed(batch, seq)
    return _sample(f"{name}-b{batch}-s{seq}", path, feed, {k: v.shape for k, v in feed.items()},
                   {"batch": batch, "seq": seq})


def qdq_models() -> list[SampleModel]:
    return [qdq_net(False), qdq_net(True), qdq_squeezenet(False), qdq_squeezenet(True),
            qdq_minilm(False), qdq_minilm(True)]


def _name(model: str, per_channel: bool) -> str:
    return f"{model}-{'per-channel' if per_channel else 'per-tensor'}"


def _quantized(source: Path, folder: Path, feeds: list[dict], per_channel: bool, op_types=None) -> Path:
    from onnxruntime.quantization import QuantFormat, quantize_static

    target = folder / "qdq.onnx"
    quantize_static(source, target, calibration_reader(feeds), quant_format=QuantFormat.QDQ,
                    per_channel=per_channel, op_types_to_quantize=op_types)
    return target


def _sample(name: str, path: Path, feed: dict, input_shapes: dict, dims: dict | None = None) -> SampleModel:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, feed)))
    return SampleModel(name, path, feed, outputs, input_shapes, dims or {})
