"""The interface of a language model with a key/value cache, read from its ONNX inputs and outputs,
and the shape specializations that compile it for generation.

Exporters agree on the names: `input_ids` [B, S], `attention_mask` [B, T], optional `position_ids`
[B, S], and per layer `past_key_values.N.key` / `.value` [B, KVH, P, HD] in, `present.N.key` /
`.value` out (onnxruntime-genai's builder, optimum, transformers.js). They differ in how the present
cache relates to the past:
- **shared buffer** (GroupQueryAttention, as onnxruntime-genai's builder writes it): the present is
  the past buffer with this step's rows written at the cache's length, which the attention reads from
  the mask (seqlens_k = sum(mask) - 1). Present length = max(T, P); the mask spans the buffer (T = P).
- **concat** (standard attention, torch exports): present = Concat(past, new rows), length P + S;
  the mask spans both (T = P + S) and zeroes the buffer's padding.

`generation_specializations` makes one specialization per (new tokens S, past bucket P): S = 1
decodes, the prefill chunks are larger S; they share one copy of the weights on disk as every
shape specialization does (cortex/shared_cu_weights.py). Batch is 1. Their present outputs are
only the step's new rows, [1, KVH, S, HD] (passes/new_cache_rows.py): the runtime writes nothing
else into its cache, and copying whole buffers out cost a fifth of a decode step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import onnx

from cortex.specializations import Specialization
from passes.new_cache_rows import NewCacheRows
from ir.errors import CortexError

TOKENS, MASK, POSITIONS = "input_ids", "attention_mask", "position_ids"
# A generation step runs every CU, so CU borders only cost copies (of the key/value cache above all):
# a decoder builds about one CU per layer unless --max-cu-depth / --max-cu-size say otherwise
# (Qwen2.5-0.5B's shape, decode at a 1280-token past: 609 CUs 114 ms, 27 CUs 96 ms per token).
GENERATION_LIMITS = {"max_cu_depth": 40, "max_cu_size": 50_000_000}
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT_FORMS = ("present.{layer}.{kind}", "present_key_values.{layer}.{kind}")
SHARED, CONCAT = "shared", "concat"


@dataclass(frozen=True)
class DecoderIO:
    past: tuple[str, ...]          # past_key_values.N.key / .value, by layer then key before value
    present: tuple[str, ...]       # the matching outputs, in the same order
    kv_heads: int | str            # an int, or the symbolic dim's name
    head_size: int | str
    layout: str                    # SHARED or CONCAT
    has_positions: bool
    logits: str = "logits"

    @property
    def layers(self) -> int:
        return len(self.past) // 2

    def present_for(self, past_name: str) -> str:
        return self.present[self.past.index(past_name)]


def read_decoder_io(model: onnx.ModelProto, label: str) -> DecoderIO:
    """The ONNX model's decoder interface; one error naming `label` when it has none."""
    shared = any(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    return decoder_io({v.name: _dims(v) for v in model.graph.input}, {v.name: [] for v in model.graph.output},
                      label, SHARED if shared else CONCAT)


def decoder_io(inputs: dict[str, list], outputs: dict[str, list], label: str, layout: str) -> DecoderIO:
    """The interface from the inputs' and outputs' names and dims (an ONNX model's, a dag's)."""
    missing = [name for name in (TOKENS, MASK) if name not in inputs]
    past = sorted((n for n in inputs if _PAST.match(n)),
                  key=lambda n: (int(_PAST.match(n).group(1)), _PAST.match(n).group(2) != "key"))
    if missing or not past:
        what = ", ".join(missing + ([] if past else ["past_key_values.N.key/.value"]))
        raise CortexError(f"{label}: not a language model with a key/value cache (no {what} input)")
    present = []
    for name in past:
        layer, kind = _PAST.match(name).groups()
        found = [f.format(layer=layer, kind=kind) for f in _PRESENT_FORMS if f.format(layer=layer, kind=kind) in outputs]
        if not found:
            raise CortexError(f"{label}: input {name} has no present output (present.{layer}.{kind})")
        present.append(found[0])
    if "logits" not in outputs:
        raise CortexError(f"{label}: a language model must output 'logits'")
    first = inputs[past[0]]
    if len(first) != 4:
        raise CortexError(f"{label}: {past[0]} has rank {len(first)}; expected [batch, kv_heads, past, head_size]")
    return DecoderIO(tuple(past), tuple(present), first[1], first[3], layout, POSITIONS in inputs)


GENAI_CONFIG = "genai_config.json"


def genai_config(folder: Path) -> dict:
    """The "model" section of the genai_config.json onnxruntime-genai's builder writes beside a
    model ({} without one): head sizes, context length, end-of-sequence ids."""
    config = Path(folder) / GENAI_CONFIG
    if not config.is_file():
        return {}
    try:
        model = json.loads(config.read_text())["model"]
        if not isinstance(model, dict):
            raise TypeError("'model' is not an object")
        return model
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CortexError(f"{config}: not a readable {GENAI_CONFIG}: {e}") from None


def read_genai_head_size(model_path: Path) -> dict[str, int]:
    """Dims genai_config.json fixes (its builder leaves the head size symbolic, `kv_cache_dim`)."""
    decoder = genai_config(Path(model_path).parent).get("decoder")
    if decoder is None:
        return {}
    try:
        return {"head_size": int(decoder["head_size"]), "kv_heads": int(decoder["num_key_value_heads"])}
    except (ValueError, KeyError, TypeError) as e:
        raise CortexError(f"{Path(model_path).parent / GENAI_CONFIG}: not a readable {GENAI_CONFIG}: {e}") from None


def generation_specializations(model_path: Path, buckets: list[int], chunks: list[int],
                               dims: dict[str, int]) -> list[Specialization]:
    """One specialization per new-token count (1 and each prefill chunk) and past bucket. Symbolic
    head counts and sizes come from `dims` (--dim) or genai_config.json."""
    model = onnx.load(str(model_path), load_external_data=False)
    io = read_decoder_io(model, str(model_path))
    known = read_genai_head_size(model_path)
    kv_heads = _bound(io.kv_heads, dims, known.get("kv_heads"), "kv_heads", io.past[0], model_path)
    head_size = _bound(io.head_size, dims, known.get("head_size"), "head_size", io.past[0], model_path)
    if not buckets or any(b < 1 for b in buckets) or any(c < 2 for c in chunks):
        raise CortexError("--kv-buckets takes positive lengths and --prefill-chunks lengths of at least 2")
    found = []
    for bucket in sorted(set(buckets)):
        for tokens in [1, *sorted(set(chunks))]:
            if tokens > bucket:
                continue
            mask = bucket if io.layout == SHARED else bucket + tokens
            shapes = {TOKENS: (1, tokens), MASK: (1, mask),
                      **{name: (1, kv_heads, bucket, head_size) for name in io.past}}
            if io.has_positions:
                shapes[POSITIONS] = (1, tokens)
            rows = NewCacheRows(io.present, MASK, tokens, None if io.layout == SHARED else bucket)
            found.append(Specialization(f"tokens={tokens},kv={bucket}", shapes, dict(dims), graph_passes=(rows,)))
    return found


def _bound(dim: int | str, dims: dict[str, int], known: int | None, what: str, name: str, model_path: Path) -> int:
    if isinstance(dim, int) and dim > 0:
        return dim
    if dim in dims:
        return dims[dim]
    if known is not None:
        return known
    raise CortexError(f"{model_path}: the {what} of {name} is the symbolic dim {dim!r}: bind it with --dim {dim}=N")


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]
