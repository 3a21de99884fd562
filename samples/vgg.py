"""VGG with random weights, exported from a torch definition into `.cache/models/`.

The architecture is the model zoo's (Simonyan and Zisserman's configuration E for vgg19: sixteen
3x3 convolutions with ReLU in five max-pooled stages, then three fully connected layers); at a
224x224 input the last feature map is already 7x7, so torchvision's adaptive pooling is the
identity and is left out. `width` scales every layer's channels (1.0: the real vgg19, 548 MB of
float32 weights), for a smaller model of the same shape.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from samples.cache import CACHE_DIR, ensure_file

OPSET = 17
STAGES = {"A": (1, 1, 2, 2, 2), "E": (2, 2, 4, 4, 4)}     # convolutions per stage: vgg11, vgg19
CHANNELS = (64, 128, 256, 512, 512)
HIDDEN = 4096


def vgg_name(config: str = "E", width: float = 1.0, image: int = 224) -> str:
    depth = {"A": 11, "E": 19}[config]
    return f"vgg{depth}" + ("" if width == 1.0 else f"-w{width:g}") + ("" if image == 224 else f"-{image}px")


def vgg_input(image: int = 224, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((1, 3, image, image)).astype(np.float32)}


def ensure_vgg(config: str = "E", width: float = 1.0, image: int = 224, force: bool = False) -> Path:
    path = CACHE_DIR / "models" / f"{vgg_name(config, width, image)}.onnx"
    return ensure_file(path, lambda tmp: _export(tmp, config, width, image), force)


def _export(path: Path, config: str, width: float, image: int) -> None:
    import torch  # only to build the model once; the cached file is plain ONNX

    torch.manual_seed(0)
    layers: list = []
    channels = 3
    for convs, out in zip(STAGES[config], CHANNELS):
        out = max(1, int(out * width))
        for _ in range(convs):
            layers += [torch.nn.Conv2d(channels, out, 3, padding=1), torch.nn.ReLU()]
            channels = out
        layers.append(torch.nn.MaxPool2d(2, 2))
    side = image // 32
    hidden = max(1, int(HIDDEN * width))
    layers += [torch.nn.Flatten(), torch.nn.Linear(channels * side * side, hidden), torch.nn.ReLU(),
               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1000)]
    model = torch.nn.Sequential(*layers).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(vgg_input(image)["x"]),), str(path), dynamo=False,
                          opset_version=OPSET, input_names=["x"], output_names=["logits"])
