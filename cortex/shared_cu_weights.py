"""The CU folders of shape specializations keep each weight once, as ONNX external data.

Every specialization's cu.onnx holds the same weights (only the activations' shapes differ), so
after decompose each cu.onnx moves to the shared `models/` folder beside the per-shape folders, with
every initializer of at least `MIN_EXTERNAL_BYTES` as external data in `models/weights/<sha256>.bin`
(ONNX's own mechanism: onnxruntime, Netron and our importer read it, and the files sit inside the
model's folder as both require); a fallback CU (`runs_on`) keeps its weights inline. Each manifest then names its CUs as `../models/<shape>.<cu>.onnx`
with the new file's sha256.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx

from cortex.cus import MANIFEST
from ir.fs import sha256_bytes

MODELS_FOLDER = "models"
MIN_EXTERNAL_BYTES = 1024     # smaller tensors cost more as a file than they save


def share_cu_weights(root: Path, folders: list[str]) -> None:
    """Rewrite the CU folders `root/<folder>` (fresh from decompose, inside a temporary folder)."""
    models = Path(root) / MODELS_FOLDER
    (models / "weights").mkdir(parents=True, exist_ok=True)
    for folder in folders:
        path = Path(root) / folder / MANIFEST
        manifest = json.loads(path.read_text())
        for cu in manifest["cus"]:
            source = Path(root) / folder / cu["path"]
            model = onnx.load(str(source))
            # A fallback CU's cu.onnx is its artifact, which onnxruntime loads from bytes (after
            # checking its sha256): its weights stay inside it.
            for tensor in _initializers(model.graph) if "runs_on" not in cu else ():
                _externalize(tensor, models)
            data = model.SerializeToString()
            name = f"{folder}.{cu['id']}.onnx"
            (models / name).write_bytes(data)
            shutil.rmtree(source.parent)
            cu["path"], cu["sha256"] = f"../{MODELS_FOLDER}/{name}", sha256_bytes(data)
        path.write_text(json.dumps(manifest, indent=2) + "\n")


def _initializers(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _initializers(sub)


def _externalize(tensor: onnx.TensorProto, models: Path) -> None:
    if not tensor.HasField("raw_data") or len(tensor.raw_data) < MIN_EXTERNAL_BYTES:
        return
    data = tensor.raw_data
    location = f"weights/{sha256_bytes(data)}.bin"
    if not (models / location).exists():
        (models / location).write_bytes(data)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(data)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
