"""Cortex: an ahead-of-time compiler from ONNX to computation units.

    import cortex
    model = cortex.load("out/dag.json", device="wasm")
    outputs = model.run({"x": x})          # dict of name -> numpy array
"""


def load(dag_path, device: str = "wasm"):
    """A compiled model from dag.json, ready to `run({name: array}) -> {name: array}`."""
    from cortex.runtime import load as _load
    return _load(dag_path, device)


__all__ = ["load"]
