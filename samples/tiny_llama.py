"""A small Llama-style decoder (transformers' LlamaForCausalLM from a small config, random weights),
exported so that one call scores a whole fixed-length prompt, cached at
`.cache/models/tiny-llama-*.onnx`.

Hidden 256, 4 layers, 4 heads, SwiGLU MLP of 688, vocabulary 1000, untied LM head; no past key
values (one call is the prefill of SEQ tokens). Its linear layers are plain MatMuls against
constant weights, the shape onnxruntime's MatMulNBitsQuantizer turns into 4-bit MatMulNBits: a
stand-in for the int4 language models that ship that way, small enough to build in seconds.

Input `input_ids` [1, SEQ] int64; output `logits` [1, SEQ, VOCAB]. The attention mask is all ones,
built inside the model: without one, transformers looks for packed sequences with `torch.diff`,
which has no ONNX export.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from samples.cache import CACHE_DIR, ensure_file

OPSET = 17
HIDDEN, LAYERS, HEADS, MLP, VOCAB, SEQ = 256, 4, 4, 688, 1000, 32


def tiny_llama_path() -> Path:
    return CACHE_DIR / "models" / f"tiny-llama-h{HIDDEN}-l{LAYERS}-s{SEQ}.onnx"


def ensure_tiny_llama(force: bool = False) -> Path:
    return ensure_file(tiny_llama_path(), _export, force)


def tiny_llama_feed() -> dict[str, np.ndarray]:
    return {"input_ids": np.random.default_rng(7).integers(0, VOCAB, (1, SEQ), dtype=np.int64)}


def _export(path: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4 * SEQ,
                         attn_implementation="eager", use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()

    class Prefill(torch.nn.Module):
        """Logits only, with the all-ones mask made here (see the module's docstring)."""

        def __init__(self, llama):
            super().__init__()
            self.llama = llama

        def forward(self, input_ids):
            return self.llama(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits

    ids = torch.from_numpy(tiny_llama_feed()["input_ids"])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Prefill(model), (ids,), str(path), dynamo=False, opset_version=OPSET,
                          input_names=["input_ids"], output_names=["logits"])
