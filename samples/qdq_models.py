"""QDQ-format models: onnxruntime's `quantize_static` with `QuantFormat.QDQ`, per tensor and per
channel, cached at `.cache/models/qdq-*.onnx`:

- the small Conv/Gemm/MatMul net of `samples/contrib_models.py` (its QOperator twin is there);
- the onnx wheel's light models (`samples/light_models.py`): squeezenet, and through `qdq_light`
  any of the others (given random weights, see there; tests/test_qdq_light_models.py runs them);
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
from cortex.tools.exact_u8s8 import reference_source
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
    """One of the onnx wheel's light models (`samples/light_models.py`), edited before quantizing
    so that its activations stay finite and O(1) and its output carries information: its weights
    are ConstantOfShape fills (every class scores alike), and they become seeded random
    initializers drawn for their role (`_weight_fill`), with each BatchNormalization's statistics
    then measured on the first calibration feed (`_with_batch_statistics`)."""
    float_model = light_model(model)
    (input_name, x), = float_model.inputs.items()
    name = _name(model, per_channel)
    rng = np.random.default_rng(3)
    feeds = [{input_name: rng.uniform(0, 1, x.shape).astype(np.float32)} for _ in range(3)]

    def build(folder: Path) -> Path:
        from onnxruntime.quantization.shape_inference import quant_pre_process

        # Opset 13 first: per-axis DequantizeLinear needs it, and the quantizer would only go to 11.
        converted = onnx.version_converter.convert_version(_with_random_weights(onnx.load(float_model.path)), 13)
        converted = _with_batch_statistics(converted, feeds[0])
        # onnxruntime's recipe: its pre-processing folds each BatchNormalization (and a Mul and
        # Add by constants) into the Conv before it, so the Conv's output is quantized once after
        # the whole affine map. Left unfolded, a BatchNormalization dividing by a small variance
        # magnifies the quantized Conv output's rounding, and two correct runtimes that round one
        # value the other way differ by tens of steps a few layers on (shufflenet: onnxruntime's
        # own optimised and unoptimised runs did).
        prepared = folder / "prepared.onnx"
        quant_pre_process(_save(converted, folder, "float.onnx"), prepared)
        return _quantized(prepared, folder, feeds, per_channel)
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
    """The model with each ConstantOfShape weight replaced by a seeded random initializer drawn
    for the role it plays where it is read (`_weight_fill`): a documented edit of the source model,
    so that its activations stay finite and O(1) and its output carries information."""
    rng = np.random.default_rng(0)
    shapes = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    readers = {}
    for node in model.graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, slot))
    nodes = []
    for node in model.graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in shapes:
            nodes.append(node)
            continue
        shape = tuple(int(d) for d in shapes[node.input[0]])
        values = _weight_fill(rng, shape, *_reader_of(node.output[0], shape, readers, shapes))
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


def _with_batch_statistics(model: onnx.ModelProto, feed: dict) -> onnx.ModelProto:
    """Each BatchNormalization's mean and variance set to the per-channel statistics of what it
    reads on `feed`, as training leaves them: random ones let activations grow through residual
    sums (resnet50 and shufflenet reached 1e5 and a one-hot Softmax). A BatchNormalization's
    input is only measured right once every one upstream of it is set, so they are set level by
    level, one run each; the statistics are graph inputs of one session meanwhile."""
    import onnxruntime as ort

    norms = [node for node in model.graph.node if node.op_type == "BatchNormalization"]
    if not norms:
        return model
    level, depth = {}, {}               # BatchNormalizations upstream, on the longest path
    for node in model.graph.node:
        upstream = max((depth.get(name, 0) for name in node.input), default=0)
        level[id(node)] = upstream
        for name in node.output:
            depth[name] = upstream + (node.op_type == "BatchNormalization")
    weights = {init.name: init for init in model.graph.initializer}
    statistics = {node.input[slot]: numpy_helper.to_array(weights[node.input[slot]]) for node in norms for slot in (3, 4)}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    kept = [init for init in probe.graph.initializer if init.name not in statistics]
    del probe.graph.initializer[:]
    probe.graph.initializer.extend(kept)
    probe.graph.input.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, value.shape)
                             for name, value in statistics.items())
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(node.input[0]) for node in norms)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for current in sorted({level[id(node)] for node in norms}):
        seen = session.run(None, {**feed, **statistics})
        for node, x in zip(norms, seen):
            if level[id(node)] == current:
                axes = tuple(a for a in range(x.ndim) if a != 1)
                statistics[node.input[3]] = x.mean(axis=axes).astype(np.float32)
                statistics[node.input[4]] = x.var(axis=axes).astype(np.float32)
    for name, value in statistics.items():
        weights[name].CopyFrom(numpy_helper.from_array(value, name))
    return model


def _reader_of(name: str, shape: tuple, readers: dict, shapes: dict) -> tuple[onnx.NodeProto, int, tuple]:
    """The node that reads constant `name` as a weight, its input slot, and the weight's shape
    there: followed through the Reshape (to a constant shape) and Unsqueeze that only reshape it,
    as inception_v1's classifier weight (1, 1, 1000, 1024) read by its Gemm as (1000, 1024)."""
    (node, slot), = readers[name]
    if node.op_type == "Reshape" and slot == 0 and node.input[1] in shapes:
        target = tuple(int(d) for d in shapes[node.input[1]])
        return _reader_of(node.output[0], tuple(np.empty(shape, np.bool_).reshape(target).shape), readers, shapes)
    if node.op_type == "Unsqueeze" and slot == 0:
        axes = [a.ints for a in node.attribute if a.name == "axes"][0]
        return _reader_of(node.output[0], tuple(np.expand_dims(np.empty(shape, np.bool_), tuple(axes)).shape),
                          readers, shapes)
    return node, slot, shape


def _weight_fill(rng: np.random.Generator, shape: tuple, reader: onnx.NodeProto, slot: int,
                 shape_there: tuple) -> np.ndarray:
    """He-scaled Conv and Gemm weights (activations keep their size through each ReLU layer),
    small biases and shifts, and multipliers and variances near one: random normal values as
    a variance would make BatchNormalization take square roots of negatives (shufflenet's NaNs)."""
    op = reader.op_type
    if op in ("Conv", "Gemm") and slot == 1:
        trans_b = any(a.name == "transB" and a.i for a in reader.attribute)
        fan_in = int(np.prod(shape_there[1:])) if op == "Conv" or trans_b else shape_there[0]
        return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
    if (op in ("Conv", "Gemm") and slot == 2) or (op == "BatchNormalization" and slot in (2, 3)) or op == "Add":
        return rng.standard_normal(shape) * 0.1
    if (op == "BatchNormalization" and slot in (1, 4)) or op == "Mul":
        return rng.uniform(0.5, 1.5, shape)
    raise ValueError(f"{reader.name or op}: no random fill for a constant read as {op} input {slot}")


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
