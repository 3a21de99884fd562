"""Small recurrent layers (one node, random constant weights) covering the attributes, and their
onnxruntime reference: shared by the split tests and the lowering tests."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from wasm_cases import make_model, run_onnxruntime


def layer_model(op, input_size=12, hidden=8, seq=5, batch=3, direction="bidirectional", layout=0,
                lengths=False, initial=False, peepholes=False, only_y=False, **attrs):
    """One recurrent node with random constant weights; the model's inputs are X and, when asked,
    sequence_lens and the initial states."""
    rng = np.random.default_rng(3)
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    dirs = 2 if direction == "bidirectional" else 1
    x_shape = [batch, seq, input_size] if layout else [seq, batch, input_size]
    state_shape = [batch, dirs, hidden] if layout else [dirs, batch, hidden]
    inits = [helper.make_tensor(name, TensorProto.FLOAT, shape, (0.3 * rng.standard_normal(shape)).ravel())
             for name, shape in (("W", [dirs, gates * hidden, input_size]), ("R", [dirs, gates * hidden, hidden]),
                                 ("B", [dirs, 2 * gates * hidden]))]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    names = ["X", "W", "R", "B", "", "", "", ""]
    feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
    if lengths:
        inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, [batch]))
        names[4] = "lens"
        feeds["lens"] = rng.integers(1, seq + 1, batch).astype(np.int32)
    if initial:
        states = ["h0", "c0"] if op == "LSTM" else ["h0"]
        for i, state in enumerate(states):
            inputs.append(helper.make_tensor_value_info(state, TensorProto.FLOAT, state_shape))
            names[5 + i] = state
            feeds[state] = rng.standard_normal(state_shape).astype(np.float32)
    if peepholes:
        inits.append(helper.make_tensor("P", TensorProto.FLOAT, [dirs, 3 * hidden],
                                        (0.3 * rng.standard_normal(dirs * 3 * hidden))))
        names[7] = "P"
    outs = ["Y"] if only_y else ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    y_shape = [batch, seq, dirs, hidden] if layout else [seq, dirs, batch, hidden]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, y_shape if o == "Y" else state_shape)
               for o in outs]
    used = len(names) - next(i for i, n in enumerate(reversed(names)) if n)
    node = helper.make_node(op, names[:used], outs, hidden_size=hidden, direction=direction,
                            **({"layout": layout} if layout else {}), **attrs)
    return make_model([node], inputs, outputs, inits, opset=17), feeds


CASES = {
    "lstm-lengths-initial-peepholes": ("LSTM", {"lengths": True, "initial": True, "peepholes": True}),
    "lstm-layout1-clip": ("LSTM", {"layout": 1, "clip": 0.7, "initial": True}),
    "lstm-activations": ("LSTM", {"activations": ["HardSigmoid", "Tanh", "Softsign"] * 2,
                                  "activation_alpha": [0.3, 1.0, 1.0, 0.25, 1.0, 1.0],
                                  "activation_beta": [0.4, 0.0, 0.0, 0.6, 0.0, 0.0]}),
    "lstm-reverse": ("LSTM", {"direction": "reverse", "lengths": True}),
    "lstm-only-y": ("LSTM", {"only_y": True}),
    "gru-forward-only-y": ("GRU", {"direction": "forward", "only_y": True, "input_size": 24}),
    "gru-linear-before-reset": ("GRU", {"linear_before_reset": 1, "lengths": True, "initial": True}),
    "gru-reset-first-layout1": ("GRU", {"linear_before_reset": 0, "layout": 1, "initial": True}),
    "rnn-relu-clip": ("RNN", {"activations": ["Relu", "Tanh"], "clip": 2.0, "initial": True,
                              "input_size": 24, "hidden": 16}),
}


def expected_outputs(op, attrs, model, feeds):
    """onnxruntime's outputs; for a batch-major layer (which onnxruntime does not run), those of the
    same layer time-major, on the transposed inputs, transposed back."""
    if not attrs.get("layout"):
        return run_onnxruntime(model, feeds)
    time_major, _ = layer_model(op, **{**attrs, "layout": 0})
    turned = {k: v.transpose(1, 0, 2) if v.ndim == 3 else v for k, v in feeds.items()}
    return {k: v.transpose(2, 0, 1, 3) if v.ndim == 4 else v.transpose(1, 0, 2)
            for k, v in run_onnxruntime(time_major, turned).items()}
