"""Generation: language models run token by token over CUs compiled for it (`cortex build
--kv-buckets`), with the key/value cache and a prefix cache in the runtime.

    from cortex.generation import generate
    for token in generate("model-folder", [1, 2, 3], max_new_tokens=16):
        print(token)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from cortex.generation.generator import Generator
from cortex.generation.sampling import Sampling
from cortex.generation.source import GenerationBuild, resolve
from cortex.runtime.options import RuntimeOptions

__all__ = ["Generator", "Sampling", "GenerationBuild", "generate", "open_generator"]


def open_generator(path, device: str = "wasm", options: RuntimeOptions | None = None,
                   build: GenerationBuild = GenerationBuild(), progress: bool = True, **generator_options) -> Generator:
    return Generator(resolve(Path(path), build, progress).dag, device, options, **generator_options)


def generate(path, prompt_ids, max_new_tokens: int = 32, sampling: Sampling = Sampling(), stop_ids=(),
             device: str = "wasm", options: RuntimeOptions | None = None) -> Iterator[int]:
    """The new token ids, one by one, for `prompt_ids` on the model at `path` (see source.py)."""
    generator = open_generator(path, device, options)
    try:
        yield from generator.generate(prompt_ids, max_new_tokens, sampling, stop_ids)
    finally:
        generator.close()
