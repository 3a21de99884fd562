"""`cortex generate MODEL --prompt-ids 1,2,3 | --prompt TEXT`: new tokens from a language model
compiled for generation (cortex/generation/). Text needs a tokenizer.json beside the model, read with
the `tokenizers` library. `--stream` prints each token as it is made; `--json` prints the ids, the
text and the trace (prefix-cache hits, prefill steps, bucket growths, K/V bytes, time to first token,
decode ms per token)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated, Optional

import typer

from cortex.commands.generated_options import with_options
from cortex.commands.shared_options import DeviceOption
from cortex.console import out, print_json, print_summary
from cortex.generation import GenerationBuild, Generator, Sampling
from cortex.generation.source import resolve
from cortex.generation.text import Tokenizer
from cortex.runtime.options import RuntimeOptions
from ir.errors import CortexError


@with_options(RuntimeOptions, into="runtime", defaults={"cache_bytes": 0})
@with_options(Sampling, into="sampling")
@with_options(GenerationBuild, into="build")
def generate(
    model: Annotated[Path, typer.Argument(help="What `cortex build --kv-buckets` wrote (folder or dag.json), or a "
                                          "model folder as onnxruntime-genai's builder writes it (built on first use).")],
    runtime: RuntimeOptions,
    sampling: Sampling,
    build: GenerationBuild,
    prompt_ids: Annotated[Optional[str], typer.Option("--prompt-ids", help="The prompt's token ids, comma-separated.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="The prompt as text (needs tokenizer.json beside the model).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Stop after this many new tokens.")] = 32,
    stop_ids: Annotated[Optional[str], typer.Option("--stop-ids", help="Comma-separated ids that end generation (the "
                                                    "stop id is output; default: genai_config.json's eos_token_id, "
                                                    "'' for none).")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print each token as it is made.")] = False,
    device: DeviceOption = "wasm",
    json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Generate tokens with a language model, token by token, with a key/value and a prefix cache."""
    if (prompt_ids is None) == (prompt is None):
        raise CortexError("give the prompt once: --prompt-ids 1,2,3 or --prompt TEXT")
    source = resolve(model, build, progress=not json)
    tokenizer = Tokenizer.beside(source.tokenizer) if prompt is not None or source.tokenizer else None
    if prompt is not None:
        if tokenizer is None:
            raise CortexError(f"--prompt needs a tokenizer.json beside {model}; give --prompt-ids instead")
        ids = tokenizer.encode(prompt)
    else:
        ids = _ids("--prompt-ids", prompt_ids)
    stops = source.stop_ids if stop_ids is None else _ids("--stop-ids", stop_ids)
    generator = Generator(source.dag, device, runtime)
    try:
        made = []
        for token in generator.generate(ids, max_new_tokens, sampling, stops):
            made.append(token)
            if stream and not json:
                piece = tokenizer.decode([token]) + " " if tokenizer else f"{token} "
                out.print(piece, end="")
        trace = generator.trace
    finally:
        generator.close()
    text = tokenizer.decode(made) if tokenizer else None
    if json:
        print_json({"model": str(model), "prompt_ids": [int(i) for i in ids], "ids": made,
                    **({"text": text} if text is not None else {}), "trace": trace})
        return
    if stream:
        out.print()
    else:
        out.print(text if text is not None else ",".join(map(str, made)))
    decode = trace["decode_ms"]
    print_summary("Generated", [("new tokens", str(len(made))), ("finish", trace["finish"]),
                                ("prompt tokens (from the prefix cache)",
                                 f"{trace['prompt_tokens']} ({trace['prefix_hit_tokens']})"),
                                ("time to first token", f"{trace['ttft_ms']:.1f} ms"),
                                ("decode", f"{statistics.median(decode):.2f} ms/token" if decode else "-"),
                                ("key/value cache", f"{trace['kv_bytes']:,} bytes at {trace['bucket']} tokens")])


def _ids(flag: str, text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.lstrip("-").isdigit() for p in parts):
        raise CortexError(f"bad {flag} {text!r}: expected comma-separated integers, e.g. 1,2,3")
    return [int(p) for p in parts]
