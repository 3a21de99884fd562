"""The small sample models committed in `samples/`: an MLP, a CNN and one transformer encoder block.

They are tiny torch modules with fixed seeds, exported at opset 17 with the TorchScript exporter.
BatchNorm is exported as its own op (not folded into the Conv by the exporter) so Cortex's own
passes have something to fuse; the transformer block keeps its Shape -> Gather -> Concat -> Reshape
subgraphs because `seq` is dynamic.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import nn

SAMPLES_DIR = Path(__file__).resolve().parent
OPSET = 17


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                    nn.Linear(64, 10))

    def forward(self, x):
        return self.layers(x)


class ConvBlock(nn.Sequential):
    def __init__(self, cin, cout, stride=1):
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = ConvBlock(3, 16)
        self.res_a = ConvBlock(16, 16)
        self.res_b = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
        self.down = ConvBlock(16, 32, stride=2)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32 * 2 * 2, 10))

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.res_b(self.res_a(x)))  # the residual Add
        return self.head(self.pool(self.down(x)))


class TransformerBlock(nn.Module):
    """Pre-norm encoder block; attention written out so it exports as MatMul/Softmax/Transpose."""

    def __init__(self, dim=64, heads=4, hidden=256):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.head_dim ** 0.5
        attended = torch.matmul(scores.softmax(dim=-1), v).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


def _init_batchnorm_statistics(module: nn.Module) -> None:
    """Non-trivial running statistics, so folding BatchNorm is actually tested."""
    g = torch.Generator().manual_seed(7)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)


def export_sample(name: str) -> bytes:
    """The ONNX bytes of one sample (same bytes on every run)."""
    torch.manual_seed(0)
    if name == "mlp":
        module, example = MLP(), torch.randn(2, 64)
        axes = {"x": {0: "batch"}, "y": {0: "batch"}}
    elif name == "cnn":
        module, example = CNN(), torch.randn(1, 3, 32, 32)
        _init_batchnorm_statistics(module)
        axes = None
    elif name == "transformer_block":
        module, example = TransformerBlock(), torch.randn(1, 16, 64)
        axes = {"x": {1: "seq"}, "y": {1: "seq"}}
    else:
        raise ValueError(f"unknown sample {name!r}")
    module.eval()
    buffer = io.BytesIO()
    with torch.no_grad():
        # PRESERVE keeps BatchNormalization as an op: EVAL would fold it into the Conv weights.
        torch.onnx.export(module, (example,), buffer, dynamo=False, opset_version=OPSET,
                          input_names=["x"], output_names=["y"], dynamic_axes=axes,
                          training=torch.onnx.TrainingMode.PRESERVE)
    return buffer.getvalue()


SAMPLE_NAMES = ("mlp", "cnn", "transformer_block")
