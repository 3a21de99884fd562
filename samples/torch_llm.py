"""Language models as torch exports them with a key/value cache, and their 4-bit form as
transformers.js ships it, cached under `.cache/torch_llm/<name>/<precision>/` (model.onnx and a
tokenizer beside it).

The models are transformers' LlamaForCausalLM and Qwen2ForCausalLM from the small configs of
samples/genai_models.py (2 layers, hidden 64, 2 KV heads of 16) with random weights, written with
standard attention as optimum's and transformers.js's exports have it. The interface is

    input_ids [batch_size, sequence_length] int64
    attention_mask [batch_size, total_sequence_length] int64     (total = past + sequence)
    position_ids [batch_size, sequence_length] int64
    past_key_values.N.key / .value [batch_size, 2, past_sequence_length, 16] float32
 -> logits [batch_size, sequence_length, 256] float32
    present.N.key / .value [batch_size, 2, total_sequence_length, 16] float32

with present = Concat(past, this step's rows): a "concat" model (cortex/decoder_io.py). A step
after `cached` tokens held in a past buffer of P rows feeds a mask of 1 for the cached rows and the
new ones and 0 for the buffer's padding, and positions from `cached` on (`concat_step_feeds`).

Two exporters, two ways of turning the 2-D mask into the attention's:
- `dynamo` (torch.onnx.export with dynamo=True, today's default): transformers' own mask, a causal
  Range/LessOrEqual against a GatherND of the padding mask, a Where to -inf; about 200 nodes.
- `torchscript`: the exporter optimum runs for transformers.js, with the mask built as transformers
  4.4x built it (`_update_causal_mask`: a full -inf matrix, Trilu, a product with a position
  comparison, Expand, and the padding written into a slice: ScatterND, Where), the graph the
  published transformers.js models carry; about 700 nodes, a third of them Constants.
transformers' DynamicCache is no tensor, so a small module takes the past as flat tensors and
returns the present flat.

`q4` is onnxruntime's MatMulNBitsQuantizer over the fp32 model at transformers.js's q4 settings
(its scripts/quantize.py): 4-bit blocks of 32, symmetric, no accuracy level; the token embedding
(a Gather) stays float32.

`python -m samples.torch_llm [llama|qwen2] [fp32|q4] [dynamo|torchscript]` builds one and prints its folder.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx

from samples.cache import CACHE_DIR, ensure_folder
from samples.genai_models import CONFIGS, transformers_model

PRECISIONS = ("fp32", "q4")
EXPORTERS = ("dynamo", "torchscript")
Q4_BLOCK = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# the ONNX opset each exporter writes (the TorchScript one's Trilu needs 14)
OPSETS = {"dynamo": 18, "torchscript": 14}


def torch_llm(name: str = "llama", precision: str = "fp32", exporter: str = "dynamo") -> Path:
    """The folder of `name` exported by torch's `exporter` at `precision` (built once)."""
    for what, value, known in (("model", name, CONFIGS), ("precision", precision, PRECISIONS),
                               ("exporter", exporter, EXPORTERS)):
        if value not in known:
            raise ValueError(f"unknown {what} {value!r}; one of {', '.join(known)}")
    root = CACHE_DIR / "torch_llm" / name
    suffix = "" if exporter == "dynamo" else f"-{exporter}"
    source = transformers_model(name)
    fp32 = ensure_folder(root / f"fp32{suffix}", lambda folder: _export(source, folder, exporter))
    if precision == "fp32":
        return fp32
    return ensure_folder(root / f"{precision}{suffix}", lambda folder: _quantize_q4(fp32, folder))


def kv_shape(name: str) -> tuple[int, int]:
    """(KV heads, head size) of `name`'s config."""
    config = CONFIGS[name][1]
    return config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]


def concat_step_feeds(model: onnx.ModelProto, token_ids: np.ndarray, cached: int,
                      past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds of one step of a concat model: `token_ids` [1, S] after `cached` tokens, whose K/V
    rows are the first `cached` rows of each `past` buffer [1, KVH, P, HD] (zeros after). The mask
    is 1 for the cached rows and the new ones, 0 for the buffer's padding; positions continue at
    `cached`."""
    tokens = token_ids.shape[1]
    bucket = next(iter(past.values())).shape[2]
    mask = np.ones((1, bucket + tokens), np.int64)
    mask[0, cached:bucket] = 0
    feeds = {"input_ids": token_ids.astype(np.int64), "attention_mask": mask,
             "position_ids": np.arange(cached, cached + tokens, dtype=np.int64)[None], **past}
    return {value.name: feeds[value.name] for value in model.graph.input}


def _export(source: Path, folder: Path, exporter: str) -> None:
    # torch and transformers take seconds to import: only when a model is exported
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    config = model.config
    layers, kv_heads, head_size = config.num_hidden_layers, config.num_key_value_heads, \
        config.hidden_size // config.num_attention_heads
    legacy_mask = exporter == "torchscript"

    class FlatCache(torch.nn.Module):
        """The causal LM with its past and present as flat tensors, key before value, by layer."""

        def __init__(self, causal_lm):
            super().__init__()
            self.causal_lm = causal_lm

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = transformers.DynamicCache(ddp_cache_data=[past[i:i + 2] for i in range(0, len(past), 2)],
                                              config=config)
            if legacy_mask:
                attention_mask = _causal_mask_as_transformers_4(torch, attention_mask, input_ids.shape[1],
                                                                past[0].shape[2])
            out = self.causal_lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, use_cache=True)
            return out.logits, *(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values))

    past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present_names = [name.replace("past_key_values", "present") for name in past_names]
    input_names, output_names = ["input_ids", "attention_mask", "position_ids", *past_names], ["logits", *present_names]
    # example sizes all distinct and > 1, so that neither exporter takes an axis for a constant
    batch, tokens, cached = 2, 3, 5
    example = (torch.randint(0, config.vocab_size, (batch, tokens)),
               torch.ones(batch, cached + tokens, dtype=torch.int64),
               torch.arange(cached, cached + tokens).expand(batch, tokens),
               *(torch.randn(batch, kv_heads, cached, head_size) for _ in past_names))
    path = folder / "model.onnx"
    if exporter == "dynamo":
        batch_dim, tokens_dim = torch.export.Dim("batch_size"), torch.export.Dim("sequence_length")
        total_dim, past_dim = torch.export.Dim("total_sequence_length"), torch.export.Dim("past_sequence_length")
        dynamic_shapes = ({0: batch_dim, 1: tokens_dim}, {0: batch_dim, 1: total_dim},
                          {0: batch_dim, 1: tokens_dim}, tuple({0: batch_dim, 2: past_dim} for _ in past_names))
        program = torch.onnx.export(FlatCache(model), example, input_names=input_names, output_names=output_names,
                                    dynamic_shapes=dynamic_shapes, opset_version=OPSETS[exporter], dynamo=True,
                                    verbose=False)
        program.save(str(path), external_data=False)
        # torch.export names the present's axis by its sum; the interface names it as the mask's
        _rename_dim(path, "past_sequence_length + sequence_length", "total_sequence_length")
    else:
        axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
                "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
                "position_ids": {0: "batch_size", 1: "sequence_length"},
                "logits": {0: "batch_size", 1: "sequence_length"},
                **{name: {0: "batch_size", 2: "past_sequence_length"} for name in past_names},
                **{name: {0: "batch_size", 2: "total_sequence_length"} for name in present_names}}
        torch.onnx.export(FlatCache(model), example, str(path), input_names=input_names, output_names=output_names,
                          dynamic_axes=axes, opset_version=OPSETS[exporter], dynamo=False)
    _copy_tokenizer(source, folder)


def _causal_mask_as_transformers_4(torch, attention_mask, tokens: int, cached: int):
    """The additive [B, 1, S, T] mask transformers 4.4x's `_update_causal_mask` built from the
    [B, T] padding mask (a 4-D mask reaches the attention as it is)."""
    lowest = torch.finfo(torch.float32).min
    batch, total = attention_mask.shape
    positions = torch.arange(cached, cached + tokens)
    causal = torch.triu(torch.full((tokens, total), lowest), diagonal=1)
    causal = causal * (torch.arange(total) > positions.reshape(-1, 1))
    causal = causal[None, None, :, :].expand(batch, 1, -1, -1).clone()
    padding = (causal[:, :, :, :total] + attention_mask[:, None, None, :]) == 0
    causal[:, :, :, :total] = causal[:, :, :, :total].masked_fill(padding, lowest)
    return causal


def _rename_dim(path: Path, old: str, new: str) -> None:
    model = onnx.load(str(path))
    for value in model.graph.output:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == old:
                dim.dim_param = new
    onnx.save(model, str(path))


def _quantize_q4(fp32: Path, folder: Path) -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32 / "model.onnx")), bits=4, block_size=Q4_BLOCK,
                                     is_symmetric=True, accuracy_level=None)
    quantizer.process()
    onnx.save(quantizer.model.model, str(folder / "model.onnx"))
    _copy_tokenizer(fp32, folder)


def _copy_tokenizer(source: Path, folder: Path) -> None:
    for file in TOKENIZER_FILES:
        shutil.copyfile(source / file, folder / file)


if __name__ == "__main__":
    print(torch_llm(*sys.argv[1:4]))
