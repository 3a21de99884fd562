"""Where one CU sits in a model's shared linear memory (`compile-wasm --memory shared`).

A plain value the options carry to each CU's build, so that the build stays a pure function of
its graph and its options (the compile cache and `--executor ray` rely on that): the module's
region (`base`, `region_bytes`), the size of the whole memory it imports, and the absolute offset
of each input another CU of the model writes (the producer's output slot, read in place).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SharedLayout:
    base: int                                     # first byte of the CU's own region
    region_bytes: int                             # its outputs, model-input slots, weights and scratch
    memory_bytes: int                             # the whole model memory every module imports
    border_inputs: tuple[tuple[str, int], ...]    # (input name, offset of its producer's output slot)

    def to_json(self) -> dict:
        return {"memory_bytes": self.memory_bytes, "base": self.base, "region_bytes": self.region_bytes}
