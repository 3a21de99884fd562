"""A YOLO-style object detector built by code: the YOLOv8n architecture (Ultralytics' published
design: Conv-BN-SiLU blocks, C2f blocks, SPPF, a PAN neck of Upsample + Concat, a decoupled detect
head with distribution focal loss boxes), written out here in torch.nn with random weights from a
fixed seed, exported with torch.onnx.export (opset 17) for a fixed 1x3x320x320 input into
`.cache/models/detector-yolov8n-320.onnx`.

The export holds the box decoding too (a Softmax over each side's 16 bins, the bins' expectation as
a 1x1 convolution, anchor points and strides), as Ultralytics' own ONNX exports do, so the model
ends in (1, 84, 2100): 4 box coordinates (centre x, centre y, width, height in pixels) and 80 class
scores for each of the 40x40 + 20x20 + 10x10 anchors.

    from samples.detector import detector, detector_path
    m = detector()           # SampleModel: path, a seeded input feed, onnxruntime's outputs
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from samples.cache import CACHE_DIR, SampleModel, ensure_file

OPSET = 17
SIZE = 320
CLASSES = 80
REG_MAX = 16                     # bins per box side (distribution focal loss)
STRIDES = (8, 16, 32)
WIDTHS = (16, 32, 64, 128, 256)  # YOLOv8n: width multiple 0.25 of 64, 128, 256, 512, 1024
DEPTHS = (1, 2, 2, 1)            # C2f repeats in the backbone: depth multiple 0.33 of 3, 6, 6, 3
SEED = 0
INPUT = "images"
OUTPUT = "output0"


def detector_path() -> Path:
    """The exported model, built on first use."""
    return ensure_file(CACHE_DIR / "models" / f"detector-yolov8n-{SIZE}.onnx", _export)


def detector_feed() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return {INPUT: rng.random((1, 3, SIZE, SIZE), dtype=np.float32)}


def detector() -> SampleModel:
    import onnxruntime as ort

    path = detector_path()
    inputs = detector_feed()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))
    return SampleModel("detector-yolov8n", path, inputs, outputs, {INPUT: inputs[INPUT].shape})


def _modules():
    """The torch.nn modules, defined where torch is imported (tests that never build the model
    never import torch)."""
    import torch
    from torch import nn

    class ConvBnSiLU(nn.Module):
        def __init__(self, c_in, c_out, k=1, s=1):
            super().__init__()
            self.conv = nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False)
            self.bn = nn.BatchNorm2d(c_out, eps=1e-3, momentum=0.03)
            self.act = nn.SiLU()

        def forward(self, x):
            return self.act(self.bn(self.conv(x)))

    class Bottleneck(nn.Module):
        def __init__(self, c, shortcut):
            super().__init__()
            self.cv1, self.cv2, self.add = ConvBnSiLU(c, c, 3), ConvBnSiLU(c, c, 3), shortcut

        def forward(self, x):
            y = self.cv2(self.cv1(x))
            return x + y if self.add else y

    class C2f(nn.Module):
        """CSP bottleneck with two convolutions: split, n bottlenecks each feeding the next, concat all."""
        def __init__(self, c_in, c_out, n, shortcut):
            super().__init__()
            self.c = c_out // 2
            self.cv1 = ConvBnSiLU(c_in, 2 * self.c)
            self.cv2 = ConvBnSiLU((2 + n) * self.c, c_out)
            self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

        def forward(self, x):
            ys = list(self.cv1(x).chunk(2, 1))
            ys.extend(m(ys[-1]) for m in self.m)
            return self.cv2(torch.cat(ys, 1))

    class SPPF(nn.Module):
        """Spatial pyramid pooling, fast: three chained 5x5 max pools, concatenated."""
        def __init__(self, c_in, c_out):
            super().__init__()
            hidden = c_in // 2
            self.cv1, self.cv2 = ConvBnSiLU(c_in, hidden), ConvBnSiLU(hidden * 4, c_out)
            self.m = nn.MaxPool2d(5, 1, 2)

        def forward(self, x):
            ys = [self.cv1(x)]
            ys.extend(self.m(ys[-1]) for _ in range(3))
            return self.cv2(torch.cat(ys, 1))

    class Detect(nn.Module):
        """Decoupled head: per level a box branch (4 x REG_MAX bins) and a class branch, then decoding."""
        def __init__(self, channels):
            super().__init__()
            c2, c3 = max(16, channels[0] // 4, REG_MAX * 4), max(channels[0], min(CLASSES, 100))
            self.box = nn.ModuleList(nn.Sequential(ConvBnSiLU(c, c2, 3), ConvBnSiLU(c2, c2, 3),
                                                   nn.Conv2d(c2, 4 * REG_MAX, 1)) for c in channels)
            self.cls = nn.ModuleList(nn.Sequential(ConvBnSiLU(c, c3, 3), ConvBnSiLU(c3, c3, 3),
                                                   nn.Conv2d(c3, CLASSES, 1)) for c in channels)
            self.dfl = nn.Conv2d(REG_MAX, 1, 1, bias=False).requires_grad_(False)
            self.dfl.weight.data[:] = torch.arange(REG_MAX, dtype=torch.float32).view(1, REG_MAX, 1, 1)
            anchors, strides = [], []
            for stride in STRIDES:
                side = SIZE // stride
                ys, xs = torch.meshgrid(torch.arange(side) + 0.5, torch.arange(side) + 0.5, indexing="ij")
                anchors.append(torch.stack((xs, ys), -1).view(-1, 2))
                strides.append(torch.full((side * side, 1), float(stride)))
            self.register_buffer("anchors", torch.cat(anchors).transpose(0, 1).unsqueeze(0))
            self.register_buffer("strides", torch.cat(strides).transpose(0, 1).unsqueeze(0))

        def forward(self, levels):
            flat = [torch.cat((b(x), c(x)), 1).view(1, 4 * REG_MAX + CLASSES, -1)
                    for x, b, c in zip(levels, self.box, self.cls)]
            box, cls = torch.cat(flat, 2).split((4 * REG_MAX, CLASSES), 1)
            anchors = box.shape[2]
            dist = self.dfl(box.view(1, 4, REG_MAX, anchors).transpose(2, 1).softmax(1)).view(1, 4, anchors)
            lt, rb = dist.chunk(2, 1)
            x1y1, x2y2 = self.anchors - lt, self.anchors + rb
            xywh = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * self.strides
            return torch.cat((xywh, cls.sigmoid()), 1)

    class YoloV8(nn.Module):
        def __init__(self):
            super().__init__()
            w, d = WIDTHS, DEPTHS
            self.stem = nn.Sequential(ConvBnSiLU(3, w[0], 3, 2), ConvBnSiLU(w[0], w[1], 3, 2),
                                      C2f(w[1], w[1], d[0], True))
            self.p3 = nn.Sequential(ConvBnSiLU(w[1], w[2], 3, 2), C2f(w[2], w[2], d[1], True))
            self.p4 = nn.Sequential(ConvBnSiLU(w[2], w[3], 3, 2), C2f(w[3], w[3], d[2], True))
            self.p5 = nn.Sequential(ConvBnSiLU(w[3], w[4], 3, 2), C2f(w[4], w[4], d[3], True), SPPF(w[4], w[4]))
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.top_down4 = C2f(w[4] + w[3], w[3], 1, False)
            self.top_down3 = C2f(w[3] + w[2], w[2], 1, False)
            self.down3, self.bottom_up4 = ConvBnSiLU(w[2], w[2], 3, 2), C2f(w[2] + w[3], w[3], 1, False)
            self.down4, self.bottom_up5 = ConvBnSiLU(w[3], w[3], 3, 2), C2f(w[3] + w[4], w[4], 1, False)
            self.detect = Detect((w[2], w[3], w[4]))

        def forward(self, x):
            p3 = self.p3(self.stem(x))
            p4 = self.p4(p3)
            p5 = self.p5(p4)
            t4 = self.top_down4(torch.cat((self.up(p5), p4), 1))
            n3 = self.top_down3(torch.cat((self.up(t4), p3), 1))
            n4 = self.bottom_up4(torch.cat((self.down3(n3), t4), 1))
            n5 = self.bottom_up5(torch.cat((self.down4(n4), p5), 1))
            return self.detect([n3, n4, n5])

    return YoloV8, nn


def _export(path: Path) -> None:
    import torch

    YoloV8, nn = _modules()
    torch.manual_seed(SEED)
    model = YoloV8()
    # Trained-looking normalisation statistics instead of the identity, so folding them is exercised.
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    model.eval()
    x = torch.from_numpy(detector_feed()[INPUT])
    with torch.no_grad():
        torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=OPSET,
                          input_names=[INPUT], output_names=[OUTPUT])
