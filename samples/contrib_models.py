"""Models with onnxruntime's contrib ops (com.microsoft), made with onnxruntime's own public tools and
cached at `.cache/models/contrib-*.onnx`:

- `quantize_dynamic` on small helper-built models: DynamicQuantizeLSTM, and, once onnxruntime's
  graph optimiser has fused the quantizer's MatMulInteger chains (the model it saves with
  `optimized_model_filepath`), DynamicQuantizeMatMul and MatMulIntegerToFloat;
- `quantize_static` in the QOperator format on a small Conv/Gemm/MatMul net: QLinearConv,
  QLinearAdd, QLinearSigmoid, QGemm, QLinearMatMul;
- `onnxruntime.transformers.optimizer.optimize_model` on MiniLM (samples/minilm.py): Attention,
  SkipLayerNormalization, EmbedLayerNormalization, and BiasGelu or, with the GELU approximation,
  FastGelu.

The float models are built here with onnx.helper; nothing binary is committed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from samples.cache import CACHE_DIR, ensure_file
from samples.minilm import ensure_minilm

OPSET = 17


@dataclass(frozen=True)
class ContribModel:
    name: str
    path: Path
    input_shapes: dict[str, tuple[int, ...]]
    dims: dict[str, int]
    contrib_ops: tuple[str, ...]    # the com.microsoft ops the tool is expected to have written


def quantized_matmul() -> ContribModel:
    path = cached_model("dynamic-quantize-matmul", lambda d: fused(quantized_dynamic(_matmul_model(1), d), d))
    return ContribModel("dynamic-quantize-matmul", path, {"x": (2, 16)}, {}, ("DynamicQuantizeMatMul",))


def quantized_shared_matmuls() -> ContribModel:
    """Two MatMuls reading one input share its DynamicQuantizeLinear: MatMulIntegerToFloat each."""
    path = cached_model("matmul-integer-to-float", lambda d: fused(quantized_dynamic(_matmul_model(2), d), d))
    return ContribModel("matmul-integer-to-float", path, {"x": (2, 16)}, {}, ("MatMulIntegerToFloat",))


def quantized_lstm() -> ContribModel:
    path = cached_model("dynamic-quantize-lstm", lambda d: quantized_dynamic(_lstm_model(), d, ["LSTM"]))
    return ContribModel("dynamic-quantize-lstm", path, {"x": (5, 2, 4)}, {}, ("DynamicQuantizeLSTM",))


def quantized_qoperator_net() -> ContribModel:
    path = cached_model("qoperator-net", lambda d: quantized_static(_qoperator_float_model(), d, qoperator_calibration_feeds()))
    return ContribModel("qoperator-net", path, {"x": (1, 3, 12, 12)}, {},
                        ("QLinearAdd", "QLinearSigmoid", "QGemm"))


def optimized_minilm(gelu_approximation: bool = False, multi_head_attention: bool = False) -> ContribModel:
    """MiniLM through the transformer optimizer: Attention (or, with `multi_head_attention`, the
    optimizer's `use_multi_head_attention` form: MultiHeadAttention after separate Q, K and V
    projections), SkipLayerNormalization, EmbedLayerNormalization and BiasGelu (or FastGelu)."""
    name = "minilm-optimized" + ("-fastgelu" if gelu_approximation else "") + ("-mha" if multi_head_attention else "")
    path = cached_model(name, lambda d: _optimized_minilm(d, gelu_approximation, multi_head_attention))
    gelu = "FastGelu" if gelu_approximation else "BiasGelu"
    attention = "MultiHeadAttention" if multi_head_attention else "Attention"
    return ContribModel(name, path, {}, {"batch": 1, "seq": 16},
                        (attention, "SkipLayerNormalization", "EmbedLayerNormalization", gelu))


def contrib_models() -> list[ContribModel]:
    return [quantized_matmul(), quantized_shared_matmuls(), quantized_lstm(), quantized_qoperator_net(),
            optimized_minilm(), optimized_minilm(gelu_approximation=True),
            optimized_minilm(multi_head_attention=True)]


# -- building ------------------------------------------------------------------------------------
def cached_model(name: str, build: Callable[[Path], Path], prefix: str = "contrib") -> Path:
    """Build in a scratch folder (the tools pick the format from the file name), then cache."""
    def write(target: Path) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            shutil.copyfile(build(Path(scratch)), target)
    return ensure_file(CACHE_DIR / "models" / f"{prefix}-{name}.onnx", write)


def _save(model: onnx.ModelProto, folder: Path, name: str) -> Path:
    path = folder / name
    onnx.save(model, path)
    return path


def quantized_dynamic(model: onnx.ModelProto | Path, folder: Path, op_types=None) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source, target = _source(model, folder), folder / "quantized.onnx"
    quantize_dynamic(source, target, weight_type=QuantType.QInt8, op_types_to_quantize=op_types)
    return target


def fused(path: Path, folder: Path, disabled_optimizers: tuple[str, ...] = ()) -> Path:
    """onnxruntime's extended graph optimisations, saved: they fuse the quantizer's MatMulInteger
    chains (and, unless disabled by name, the transformer patterns)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(folder / "fused.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                         disabled_optimizers=list(disabled_optimizers))
    return folder / "fused.onnx"


def quantized_static(model: onnx.ModelProto | Path, folder: Path, calibration: list[dict[str, np.ndarray]]) -> Path:
    """The QOperator format (QLinearConv, QGemm, QLinearAdd...), calibrated on `calibration`'s feeds."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    source, target = _source(model, folder), folder / "quantized.onnx"
    quantize_static(source, target, calibration_reader(calibration), quant_format=QuantFormat.QOperator)
    return target


def calibration_reader(feeds: list[dict[str, np.ndarray]]):
    """onnxruntime's calibration interface over a fixed list of feeds, for `quantize_static`."""
    from onnxruntime.quantization import CalibrationDataReader

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)
    return Feeds()


def _source(model: onnx.ModelProto | Path, folder: Path) -> Path:
    """The model as a file of the scratch `folder`. onnxruntime's quantizer writes
    `<source>-inferred.onnx` beside its source and deletes it after reading: two test workers
    quantizing one cached model at once (MiniLM) removed each other's file."""
    if not isinstance(model, Path):
        return _save(model, folder, "float.onnx")
    if model.resolve().parent == folder.resolve():
        return model
    private = folder / "float.onnx"
    try:
        os.link(model, private)
    except OSError:     # another filesystem
        shutil.copyfile(model, private)
    return private


def _optimized_minilm(folder: Path, gelu_approximation: bool, multi_head_attention: bool) -> Path:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    options.enable_gelu_approximation = gelu_approximation
    options.use_multi_head_attention = multi_head_attention
    optimized = optimize_model(str(ensure_minilm()), model_type="bert", num_heads=12, hidden_size=384,
                               opt_level=0, optimization_options=options)
    path = folder / "optimized.onnx"
    optimized.save_model_to_file(str(path))
    return path


# -- the float models ----------------------------------------------------------------------------
def _weight(rng, name: str, shape) -> onnx.TensorProto:
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "float", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _matmul_model(count: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    widths = [32, 8][:count]
    weights = [_weight(rng, f"w{i}", (16, n)) for i, n in enumerate(widths)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}") for i in range(count)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                  [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["batch", n]) for i, n in enumerate(widths)],
                  weights)


def _lstm_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    hidden, width = 8, 4
    weights = [_weight(rng, "W", (1, 4 * hidden, width)), _weight(rng, "R", (1, 4 * hidden, hidden)),
               _weight(rng, "B", (1, 8 * hidden))]
    node = helper.make_node("LSTM", ["x", "W", "R", "B"], ["y", "y_h", "y_c"], name="lstm", hidden_size=hidden)
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", 1, "batch", hidden]),
               helper.make_tensor_value_info("y_h", TensorProto.FLOAT, [1, "batch", hidden])]
    return _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", "batch", width])],
                  outputs, weights)


def qoperator_calibration_feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]


def _qoperator_float_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = [_weight(rng, "w", (4, 3, 3, 3)), _weight(rng, "cb", (4,)), _weight(rng, "fw", (4 * 6 * 6, 10)),
               _weight(rng, "fb", (10,)), numpy_helper.from_array(np.array([0, -1], np.int64), "flat_shape")]
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Add", ["p", "p"], ["a"], name="add"),
             helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"),
             helper.make_node("Reshape", ["s", "flat_shape"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["g"], name="gemm"),
             helper.make_node("MatMul", ["f", "fw"], ["m"], name="matmul"),
             helper.make_node("Add", ["g", "m"], ["y"], name="sum")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 12, 12])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])], weights)
