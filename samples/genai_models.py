"""Language models as onnxruntime-genai's model builder writes them, from small transformers configs
with random weights, cached under `.cache/genai/<name>/<precision>/` (model.onnx, its weights,
genai_config.json and a tokenizer).

The builder makes what users of onnxruntime-genai ship: GroupQueryAttention with rotary embeddings,
SkipSimplifiedLayerNormalization, `past_key_values.*` inputs and `present.*` outputs, and for
`int4` on the CPU MatMulNBits with 4-bit blocks of 32 at accuracy_level 4. The builder stops
without a tokenizer beside the model; a word-level one over the vocabulary is enough for random
weights.

`python -m samples.genai_models [llama|qwen2] [int4|fp32]` builds one and prints its folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

from samples.cache import CACHE_DIR, ensure_folder

# name -> (transformers model class name, config keywords): the tiny ones have 2 layers, hidden 64,
# grouped KV heads
CONFIGS = {
    "llama": ("LlamaForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       max_position_embeddings=256, tie_word_embeddings=False)),
    "qwen2": ("Qwen2ForCausalLM", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       max_position_embeddings=256, tie_word_embeddings=False)),
    # Qwen2.5-0.5B's shape (random weights), its context cut from 32768 to 2048 so the K/V buffers
    # and the builder's rotary caches stay small
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                              num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                              max_position_embeddings=2048, rope_theta=1e6,
                                              tie_word_embeddings=True)),
}
PRECISIONS = ("int4", "fp32")


def genai_model(name: str = "llama", precision: str = "int4") -> Path:
    """The folder of `name` built at `precision` by the builder (built once)."""
    return ensure_folder(CACHE_DIR / "genai" / name / precision,
                         lambda folder: _build(transformers_model(name), folder, precision))


def transformers_model(name: str) -> Path:
    """The transformers model `name` (random weights) and its tokenizer, saved once; what the
    builder and torch's exporters both start from."""
    return ensure_folder(CACHE_DIR / "genai" / name / "hf", lambda folder: _save_transformers_model(name, folder))


def prompt_feeds(model_folder: Path, tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of a first call (no past) on a prompt of `tokens` random token ids."""
    decoder = json.loads((model_folder / "genai_config.json").read_text())["model"]["decoder"]
    model = onnx.load(str(model_folder / "model.onnx"), load_external_data=False)
    feeds = {"input_ids": np.random.default_rng(seed).integers(0, 256, (1, tokens)).astype(np.int64),
             "attention_mask": np.ones((1, tokens), np.int64)}
    empty_past = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), np.float32)
    feeds.update((value.name, empty_past) for value in model.graph.input if value.name.startswith("past_key_values."))
    return feeds


def _save_transformers_model(name: str, folder: Path) -> None:
    # torch and transformers take seconds to import: only when a model is built
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    class_name, config = CONFIGS[name]
    model_class = getattr(transformers, class_name)
    config_class = model_class.config_class
    torch.manual_seed(0)
    model_class(config_class(**config)).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config["vocab_size"])}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1",
                                         bos_token="w2").save_pretrained(folder)


def _build(source: Path, folder: Path, precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source),
                           "-o", str(folder), "-p", precision, "-e", "cpu", "-c", str(folder / ".builder-cache")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai's builder failed on {source}: {done.stderr.strip()[-2000:]}")


if __name__ == "__main__":
    print(genai_model(*sys.argv[1:3]))
