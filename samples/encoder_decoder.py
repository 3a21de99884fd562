"""A small public encoder-decoder's decoder (torch.nn.TransformerDecoder, 3 layers, d_model 256)
exported so that one decoding step is one model call, cached at
`.cache/models/encoder-decoder-s128.onnx`.

Inputs: `tokens` [1, MAX_STEPS] int64 (the tokens so far, padded with PAD after the current step;
a causal mask keeps the padding from reaching earlier positions, so every step has the same
static shapes), `memory` [1, SOURCE, 256] (the encoder's output, fixed for a whole decode) and
`memory_mask` [1, SOURCE] bool (True: a padded source position). Output: `logits` [1, MAX_STEPS,
VOCAB]; step t reads `logits[0, t]`. The memory and its mask repeat between the calls of one
decode: `decompose --cache-inputs memory,memory_mask` keeps the cross-attention key/value
projections of every layer apart, so the result cache can reuse them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from samples.cache import CACHE_DIR, ensure_file

OPSET = 17
D_MODEL = 256
HEADS = 4
LAYERS = 3
FFN = 512
VOCAB = 96
# An encoder memory of 128 positions (a paragraph of subword tokens, a few seconds of speech
# frames): the cross-attention keys and values over it are most of a step's work.
SOURCE = 128
MAX_STEPS = 16
BOS, PAD = 1, 0
CACHE_INPUTS = ("memory", "memory_mask")


def model_path() -> Path:
    return CACHE_DIR / "models" / f"encoder-decoder-s{SOURCE}.onnx"


def ensure_encoder_decoder(force: bool = False) -> Path:
    return ensure_file(model_path(), _export, force)


def source_feeds(seed: int = 3) -> dict[str, np.ndarray]:
    """The inputs that stay fixed during one decode: an encoder memory and its padding mask (the
    last eight source positions are padding)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((1, SOURCE), bool)
    mask[0, -8:] = True
    return {"memory": rng.standard_normal((1, SOURCE, D_MODEL)).astype(np.float32), "memory_mask": mask}


def first_tokens() -> np.ndarray:
    tokens = np.full((1, MAX_STEPS), PAD, np.int64)
    tokens[0, 0] = BOS
    return tokens


def greedy_decode(run, steps: int = MAX_STEPS, seed: int = 3) -> tuple[np.ndarray, list[np.ndarray]]:
    """Greedy decoding with `run(feeds) -> {"logits": ...}` (a compiled model's or onnxruntime's):
    the tokens chosen, and each step's logits row."""
    feeds = source_feeds(seed)
    tokens = first_tokens()
    rows = []
    for step in range(steps):
        logits = run({"tokens": tokens.copy(), **feeds})["logits"]
        rows.append(np.array(logits[0, step]))
        if step + 1 < MAX_STEPS:
            tokens[0, step + 1] = int(np.argmax(logits[0, step]))
    return tokens, rows


def _export(path: Path) -> None:
    import torch

    torch.manual_seed(0)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
            self.position = torch.nn.Parameter(0.02 * torch.randn(1, MAX_STEPS, D_MODEL))
            layer = torch.nn.TransformerDecoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True)
            self.decoder = torch.nn.TransformerDecoder(layer, LAYERS)
            for layer in self.decoder.layers:   # they start as copies of one; a trained model's differ
                for module in layer.modules():
                    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
                    if reset is not None and module is not layer:
                        reset()
            self.head = torch.nn.Linear(D_MODEL, VOCAB)
            causal = torch.triu(torch.full((MAX_STEPS, MAX_STEPS), float("-inf")), diagonal=1)
            self.register_buffer("causal", causal)

        def forward(self, tokens, memory, memory_mask):
            x = self.embed(tokens) + self.position
            y = self.decoder(x, memory, tgt_mask=self.causal, memory_key_padding_mask=memory_mask)
            return self.head(y)

    model = Decoder().eval()
    feeds = {"tokens": first_tokens(), **source_feeds()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the exporter's notes on the in-place masked_fill it rewrites
        torch.onnx.export(model, tuple(torch.from_numpy(v) for v in feeds.values()), str(path), dynamo=False,
                          opset_version=OPSET, input_names=list(feeds), output_names=["logits"])
