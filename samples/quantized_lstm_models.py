"""Stacked com.microsoft::DynamicQuantizeLSTM layers, built with onnx.helper in the layout
onnxruntime's `quantize_dynamic` writes (onnxruntime/quantization/operators/lstm.py): W int8
[directions, input, 4*hidden] and R int8 [directions, hidden, 4*hidden] (transposed against
LSTM's), scales and zero points per direction ([directions]) or per output channel
([directions, 4*hidden]; onnxruntime's kernel then requires int8 zero points to be 0).

`stacked_quantized_lstm` is the speaker-embedding form: layers fed one into the next, one tensor
given as both initial_h and initial_c of every layer, a bias, no sequence_lens. `torch_lstm_quantized`
goes through the realistic producer: torch's nn.LSTM exported, then `quantize_dynamic`.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def stacked_quantized_lstm(hidden: int, input_size: int, layers: int = 3, direction: str = "forward",
                           seq: int = 4, batch: int = 1, per_channel: bool = False,
                           seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """`layers` DynamicQuantizeLSTM layers; the model's inputs are x [seq, batch, input_size] and
    state [directions, batch, hidden] (every layer's initial_h and initial_c); its output the last
    layer's Y as [seq, batch, directions*hidden], and its Y_h."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    nodes, inits = [], []
    layer_input, size = "x", input_size
    for layer in range(layers):
        names = _quantized_weights(rng, f"l{layer}", dirs, size, hidden, per_channel, inits)
        y, y_h = f"l{layer}_y", (f"l{layer}_h" if layer < layers - 1 else "y_h")
        nodes.append(helper.make_node(
            "DynamicQuantizeLSTM", [layer_input, names["W"], names["R"], names["B"], "", "state", "state", "",
                                    names["W_scale"], names["W_zero_point"], names["R_scale"], names["R_zero_point"]],
            [y, y_h], name=f"lstm{layer}", domain="com.microsoft", hidden_size=hidden, direction=direction))
        # Y [seq, dirs, batch, hidden] -> [seq, batch, dirs*hidden], the next layer's X
        nodes.append(helper.make_node("Transpose", [y], [f"{y}_t"], perm=[0, 2, 1, 3]))
        inits.append(numpy_helper.from_array(np.array([0, 0, dirs * hidden], np.int64), f"l{layer}_shape"))
        layer_input = "y" if layer == layers - 1 else f"l{layer}_out"
        nodes.append(helper.make_node("Reshape", [f"{y}_t", f"l{layer}_shape"], [layer_input]))
        size = dirs * hidden
    graph = helper.make_graph(
        nodes, "stacked-dynamic-quantize-lstm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, input_size]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [dirs, batch, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [seq, batch, dirs * hidden]),
         helper.make_tensor_value_info("y_h", TensorProto.FLOAT, [dirs, batch, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((seq, batch, input_size)).astype(np.float32),
             "state": (0.5 * rng.standard_normal((dirs, batch, hidden))).astype(np.float32)}
    return model, feeds


def _quantized_weights(rng, prefix: str, dirs: int, size: int, hidden: int, per_channel: bool, inits: list) -> dict:
    """Random int8 W and R with scales that keep the gates' pre-activations near unit size, signed
    nonzero zero points per direction (or zero per channel, as onnxruntime requires), and a bias."""
    names = {}
    for key, rows in (("W", size), ("R", hidden)):
        weight = rng.integers(-127, 128, (dirs, rows, 4 * hidden)).astype(np.int8)
        scale_shape = (dirs, 4 * hidden) if per_channel else (dirs,)
        scale = (rng.uniform(0.6, 1.4, scale_shape) / (73.0 * np.sqrt(rows))).astype(np.float32)
        zero = np.zeros(scale_shape, np.int8) if per_channel else rng.integers(-9, 10, dirs).astype(np.int8)
        if not per_channel:
            zero[zero == 0] = 3
        for suffix, value in (("", weight), ("_scale", scale), ("_zero_point", zero)):
            names[key + suffix] = f"{prefix}_{key}{suffix}"
            inits.append(numpy_helper.from_array(value, names[key + suffix]))
    names["B"] = f"{prefix}_B"
    inits.append(numpy_helper.from_array((0.2 * rng.standard_normal((dirs, 8 * hidden))).astype(np.float32), names["B"]))
    return names


def torch_lstm_quantized(hidden: int, input_size: int, layers: int = 3, bidirectional: bool = False,
                         seq: int = 4, batch: int = 1, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """torch's nn.LSTM (`layers` stacked) exported to ONNX, then onnxruntime's `quantize_dynamic`
    with int8 weights: the DynamicQuantizeLSTM layers a user's export and quantization produce."""
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.manual_seed(seed)
    lstm = torch.nn.LSTM(input_size, hidden, num_layers=layers, bidirectional=bidirectional).eval()
    x = torch.randn(seq, batch, input_size)
    with tempfile.TemporaryDirectory() as scratch:
        source, target = Path(scratch) / "float.onnx", Path(scratch) / "quantized.onnx"
        buffer = io.BytesIO()
        torch.onnx.export(lstm, (x,), buffer, input_names=["x"], output_names=["y", "y_h", "y_c"],
                          opset_version=OPSET, dynamo=False)
        source.write_bytes(buffer.getvalue())
        quantize_dynamic(source, target, weight_type=QuantType.QInt8, op_types_to_quantize=["LSTM"])
        model = onnx.load(target)
    return model, {"x": x.numpy()}
