"""Cortex: an ahead-of-time compiler from ONNX to computation units.

    import cortex
    model = cortex.load("out/dag.json", device="wasm")
    outputs = model.run({"x": x})          # dict of name -> numpy array
"""

import importlib

__all__ = ["CompiledModel", "load"]


def __getattr__(name: str):
    # Resolved on first use: importing any cortex module (the console script first of all, which
    # must install its SIGINT handler before the heavy imports) does not load the runtime.
    if name in __all__:
        return getattr(importlib.import_module("cortex.runtime"), name)
    raise AttributeError(f"module 'cortex' has no attribute {name!r}")
