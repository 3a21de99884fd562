"""Cortex: an ahead-of-time compiler from ONNX to computation units.

    import cortex
    model = cortex.load("out/dag.json", device="wasm")
    outputs = model.run({"x": x})          # dict of name -> numpy array

    for token in cortex.generate("model-folder", [1, 2, 3], max_new_tokens=16):   # a language model
        print(token)
"""

import importlib

__all__ = ["CompiledModel", "load", "generate"]
_HOMES = {"CompiledModel": "cortex.runtime", "load": "cortex.runtime", "generate": "cortex.generation"}


def __getattr__(name: str):
    # Resolved on first use: importing any cortex module (the console script first of all, which
    # must install its SIGINT handler before the heavy imports) does not load the runtime.
    if name in __all__:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'cortex' has no attribute {name!r}")
