"""Text in and out of token ids, through a tokenizer.json (Hugging Face's `tokenizers` library,
which onnxruntime-genai's builder and transformers save beside a model)."""

from __future__ import annotations

from pathlib import Path

import tokenizers

from ir.errors import CortexError


class Tokenizer:
    def __init__(self, path: Path):
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:      # the library raises its own untyped exceptions for a bad file
            raise CortexError(f"{path}: not a readable tokenizer.json: {str(e).splitlines()[0]}") from None

    @classmethod
    def beside(cls, path: Path | None) -> "Tokenizer | None":
        return cls(path) if path is not None else None

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise CortexError(f"the prompt {text!r} has no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
