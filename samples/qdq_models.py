"""QDQ-format models: onnxruntime's `quantize_static` with `QuantFormat.QDQ`, per tensor and per
channel, cached at `.cache/models/qdq-*.onnx`:

- the small Conv/Gemm/MatMul net of `samples/contrib_models.py` (its QOperator twin is there);
- the onnx wheel's light models (`samples/light_models.py`): squeezenet, and through `qdq_light`
  any of the others;
- MiniLM (`samples/minilm.py`) with only its MatMuls quantized.

Each sample comes with a feed and with onnxruntime's output for it on the QDQ file (all graph
optimisations on, which is how onnxruntime itself runs such a model: its QDQ transformers fold the
DequantizeLinear/QuantizeLinear pairs into integer kernels), so tests and benchmarks share them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
from onnx import numpy_helper

from samples.cache import SampleModel
from cortex.runtime.exact_u8s8 import reference_source
from samples.contrib_models import (cached_model, _qoperator_float_model, _save, _source, calibration_reader,
                                    qoperator_calibration_feeds)
from samples.light_models import light_model
from samples.minilm import ensure_minilm, minilm_feed


def qdq_net(per_channel: bool = False) -> SampleModel:
    name = _name("net", per_channel)
    path = cached_model(name, lambda d: _quantized(_save(_qoperator_float_model(), d, "float.onnx"), d,
                                              qoperator_calibration_feeds(), per_channel), prefix="qdq")
    x = np.random.default_rng(7).standard_normal((1, 3, 12, 12)).astype(np.float32)
    return _sample(name, path, {"x": x}, {"x": (1, 3, 12, 12)})


def qdq_light(model: str, per_channel: bool = False) -> SampleModel:
    """One of the onnx wheel's light models (`samples/light_models.py`). Their weights are
    ConstantOfShape fills (every class scores alike): they become random He-scaled initializers
    first, so the quantized activations carry information."""
    float_model = light_model(model)
    (input_name, x), = float_model.inputs.items()
    name = _name(model, per_channel)
    rng = np.random.default_rng(3)
    feeds = [{input_name: rng.uniform(0, 1, x.shape).astype(np.float32)} for _ in range(3)]

    def build(folder: Path) -> Path:
        # Opset 13 first: per-axis DequantizeLinear needs it, and the quantizer would only go to 11.
        converted = onnx.version_converter.convert_version(_with_random_weights(onnx.load(float_model.path)), 13)
        source = _save(converted, folder, "float.onnx")
        return _quantized(source, folder, feeds, per_channel)
    path = cached_model(name, build, prefix="qdq")
    feed = {input_name: np.random.default_rng(4).uniform(0, 1, x.shape).astype(np.float32)}
    return _sample(name, path, feed, float_model.input_shapes)


def qdq_squeezenet(per_channel: bool = False) -> SampleModel:
    return qdq_light("squeezenet", per_channel)


def qdq_minilm(per_channel: bool = False, batch: int = 1, seq: int = 16) -> SampleModel:
    """Only the MatMuls quantized (activations uint8, weights int8), the usual recipe for BERT."""
    name = _name("minilm-matmul", per_channel)
    feeds = [minilm_feed(1, 16), minilm_feed(1, 32), minilm_feed(2, 16)]
    path = cached_model(name, lambda d: _quantized(ensure_minilm(), d, feeds, per_channel, ["MatMul"]), prefix="qdq")
    feed = minilm_feed(batch, seq)
    return _sample(f"{name}-b{batch}-s{seq}", path, feed, {k: v.shape for k, v in feed.items()},
                   {"batch": batch, "seq": seq})


def qdq_models() -> list[SampleModel]:
    return [qdq_net(False), qdq_net(True), qdq_squeezenet(False), qdq_squeezenet(True),
            qdq_minilm(False), qdq_minilm(True)]


def _name(model: str, per_channel: bool) -> str:
    return f"{model}-{'per-channel' if per_channel else 'per-tensor'}"


def _with_random_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    shapes = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in shapes:
            nodes.append(node)
            continue
        shape = tuple(int(d) for d in shapes[node.input[0]])
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 0
        values = rng.standard_normal(shape) * (np.sqrt(2.0 / fan_in) if fan_in else 0.1)
        model.graph.initializer.append(numpy_helper.from_array(values.astype(np.float32), node.output[0]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    # IR 3 lists every initializer as a graph input too, which makes it overridable and so not a
    # weight to the quantizer; IR 4 on, an initializer alone is a constant.
    constants = {init.name for init in model.graph.initializer}
    read = {name for node in nodes for name in node.input}
    kept = [init for init in model.graph.initializer if init.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    inputs = [vi for vi in model.graph.input if vi.name not in constants]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.ir_version = max(model.ir_version, 7)
    return model


def _quantized(source: Path, folder: Path, feeds: list[dict], per_channel: bool, op_types=None) -> Path:
    from onnxruntime.quantization import QuantFormat, quantize_static

    target, source = folder / "qdq.onnx", _source(source, folder)
    quantize_static(source, target, calibration_reader(feeds), quant_format=QuantFormat.QDQ,
                    per_channel=per_channel, op_types_to_quantize=op_types)
    return target


def _sample(name: str, path: Path, feed: dict, input_shapes: dict, dims: dict | None = None) -> SampleModel:
    import onnxruntime as ort

    source, reference_feed, _ = reference_source(path, feed)   # uint8 x int8 products exact here too
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, reference_feed)))
    return SampleModel(name, path, feed, outputs, input_shapes, dims or {})
