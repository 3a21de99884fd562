"""The nine "light" models that ship inside the onnx wheel (`onnx/backend/test/data/light/`).

They are the real ONNX model-zoo architectures with light weights, each with one reference output
(`light_<name>_output_0.pb`). Their input is not stored: the onnx backend test builds it as
`np.arange(n) / n` (float32) in the declared input shape, and so do we.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from samples.cache import SampleModel

LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"

LIGHT_MODEL_NAMES = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
                     "shufflenet", "squeezenet", "vgg19", "zfnet512")
# After constant folding these hold 60-140 M parameters: a round trip takes tens of seconds.
LARGE_LIGHT_MODELS = ("bvlc_alexnet", "vgg19", "zfnet512")


def light_model(name: str) -> SampleModel:
    path = LIGHT_DIR / f"light_{name}.onnx"
    model = onnx.load(path, load_external_data=False)
    weights = {init.name for init in model.graph.initializer}
    (vi,) = [vi for vi in model.graph.input if vi.name not in weights]
    shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    x = (np.arange(n, dtype=np.float32) / n).reshape(shape)
    reference = onnx.TensorProto()
    reference.ParseFromString((LIGHT_DIR / f"light_{name}_output_0.pb").read_bytes())
    outputs = {model.graph.output[0].name: numpy_helper.to_array(reference)}
    return SampleModel(name, path, {vi.name: x}, outputs, {vi.name: shape})


def light_models() -> list[SampleModel]:
    return [light_model(name) for name in LIGHT_MODEL_NAMES]
