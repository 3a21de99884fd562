"""Choosing the next token from the logits: greedy, or seeded sampling with temperature, top-k and
top-p (nucleus), as onnxruntime-genai and transformers apply them: temperature first, then top-k,
then top-p over what is left, then a draw from the renormalised distribution.

The draws come from numpy's PCG64 seeded once per generation, so one seed gives one sequence on
every machine (the probabilities are computed in float64 from float32 logits)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ir.errors import CortexError
from ir.options import option


@dataclass(frozen=True)
class Sampling:
    temperature: float = field(default=0.0, metadata=option("Divide the logits by this before sampling; 0: greedy "
                                                             "(the first largest logit)."))
    top_k: int = field(default=0, metadata=option("Sample among the K most likely tokens (0: all)."))
    top_p: float = field(default=1.0, metadata=option("Sample among the most likely tokens whose probabilities sum "
                                                      "to P (1: all)."))
    seed: int = field(default=0, metadata=option("The seed of the draws: one seed, one sequence."))

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise CortexError(f"sampling: temperature >= 0, top-k >= 0 and 0 < top-p <= 1 (got temperature "
                              f"{self.temperature}, top-k {self.top_k}, top-p {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class TokenSampler:
    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.random = np.random.Generator(np.random.PCG64(sampling.seed))

    def __call__(self, logits: np.ndarray) -> int:
        s = self.sampling
        if s.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / s.temperature
        order = np.argsort(-scaled, kind="stable")
        if s.top_k:
            order = order[:s.top_k]
        kept = scaled[order]
        probs = np.exp(kept - kept[0])
        probs /= probs.sum()
        if s.top_p < 1:
            # the smallest prefix of the most likely tokens whose mass reaches top_p
            reach = int(np.searchsorted(np.cumsum(probs), s.top_p)) + 1
            order, probs = order[:reach], probs[:reach] / probs[:reach].sum()
        drawn = int(np.searchsorted(np.cumsum(probs), self.random.random(), side="right"))
        return int(order[min(drawn, len(order) - 1)])
