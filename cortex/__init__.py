"""Cortex: an ahead-of-time compiler from ONNX to computation units.

    import cortex
    model = cortex.load("out/dag.json", device="wasm")
    outputs = model.run({"x": x})          # dict of name -> numpy array
"""

from cortex.runtime import CompiledModel, load

__all__ = ["CompiledModel", "load"]
