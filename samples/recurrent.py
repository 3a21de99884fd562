"""Recurrent layers at realistic sizes (torch.nn.LSTM / GRU / RNN) exported to ONNX, cached at
`.cache/models/recurrent-<name>.onnx`.

Each holds more than the default `--max-cu-size` (1,000,000 parameters) per layer, so decomposing
it exercises the split of recurrent layers into input projection and recurrence. The feeds are
fixed (seeded); the reference outputs come from onnxruntime on the exported model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from samples.cache import CACHE_DIR, SampleModel, ensure_file

OPSET = 17


@dataclass(frozen=True)
class Spec:
    kind: str                 # "LSTM", "GRU" or "RNN"
    input_size: int
    hidden: int
    layers: int = 1
    bidirectional: bool = False
    batch_first: bool = False
    initial_state: bool = False   # the model takes h0 (and c0) as inputs
    seq: int = 12
    batch: int = 2


# An OCR-style 2-layer bidirectional LSTM (1.97 M and 4.7 M parameters per layer), a batch-first
# bidirectional GRU (3.2 M) and a plain tanh RNN (1.4 M).
SPECS = {
    "lstm": Spec("LSTM", 256, 384, layers=2, bidirectional=True, initial_state=True),
    "gru": Spec("GRU", 512, 512, bidirectional=True, batch_first=True),
    "rnn": Spec("RNN", 1024, 768),
    "gru-small": Spec("GRU", 64, 128, seq=16, batch=1),
    "lstm-small": Spec("LSTM", 64, 128, seq=16, batch=1),
}


def model_path(name: str) -> Path:
    return CACHE_DIR / "models" / f"recurrent-{name}.onnx"


def ensure_recurrent(name: str, force: bool = False) -> Path:
    return ensure_file(model_path(name), lambda path: _export(name, path), force)


def feed(name: str) -> dict[str, np.ndarray]:
    spec = SPECS[name]
    rng = np.random.default_rng(7)
    shape = (spec.batch, spec.seq, spec.input_size) if spec.batch_first else (spec.seq, spec.batch, spec.input_size)
    found = {"x": rng.standard_normal(shape).astype(np.float32)}
    if spec.initial_state:
        state = (spec.layers * (2 if spec.bidirectional else 1), spec.batch, spec.hidden)
        found["h0"] = (0.5 * rng.standard_normal(state)).astype(np.float32)
        if spec.kind == "LSTM":
            found["c0"] = (0.5 * rng.standard_normal(state)).astype(np.float32)
    return found


def recurrent(name: str) -> SampleModel:
    import onnxruntime as ort

    path = ensure_recurrent(name)
    inputs = feed(name)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, inputs)))
    return SampleModel(name, path, inputs, outputs, {k: v.shape for k, v in inputs.items()})


def _export(name: str, path: Path) -> None:
    import torch

    spec = SPECS[name]
    torch.manual_seed(0)
    layer = getattr(torch.nn, spec.kind)(spec.input_size, spec.hidden, num_layers=spec.layers,
                                         bidirectional=spec.bidirectional, batch_first=spec.batch_first)
    layer.eval()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, *state):
            if spec.kind == "LSTM" and state:
                y, (h, c) = self.layer(x, tuple(state))
                return y, h, c
            y, h = self.layer(x, *state)
            return y, h

    inputs = feed(name)
    outputs = ["y", "h", "c"] if spec.kind == "LSTM" else ["y", "h"]
    with torch.no_grad():
        torch.onnx.export(Model(), tuple(torch.from_numpy(v) for v in inputs.values()), str(path), dynamo=False,
                          opset_version=OPSET, input_names=list(inputs), output_names=outputs)
