"""Turn named model inputs into constants with given values (`--freeze-input NAME=FILE.npy`).

Op parameters fed as graph inputs (Slice starts/ends, ReduceSum axes, Resize sizes...) must be
compile-time constants for the loop-nest backends. A deployment that always feeds the same values
can freeze them, as TVM's `from_onnx(freeze_params=True)` and onnxruntime's initializer override
do; the frozen input then leaves the compiled model's inputs. Runs first, before shape inference,
so everything downstream sees the value as a constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ir import dtypes
from ir.errors import CortexError
from ir.fs import sha256_bytes
from ir.graph import Graph
from passes.base import Pass


@dataclass
class FreezeInputs(Pass):
    name = "freeze-inputs"
    values: dict[str, np.ndarray] = field(default_factory=dict)

    def run(self, graph: Graph) -> Graph:
        by_name = {v.name: v for v in graph.inputs}
        for input_name, array in self.values.items():
            value = by_name.get(input_name)
            if value is None:
                listed = ", ".join(by_name) or "none"
                raise CortexError(f"--freeze-input names {input_name!r}, which is not an input of the model "
                                  f"(inputs: {listed})")
            if not value.is_tensor:
                raise CortexError(f"--freeze-input {input_name}: the input is not a tensor")
            array = np.asarray(array)
            given = _dtype_of(array, input_name)
            if value.dtype != dtypes.UNDEFINED and given != value.dtype:
                raise CortexError(f"--freeze-input {input_name}: the value is {dtypes.name(given)}, but the model "
                                  f"declares {dtypes.name(value.dtype)}")
            if value.shape is not None and not _fits(value.shape, array.shape):
                raise CortexError(f"--freeze-input {input_name}: shape {list(array.shape)} contradicts the declared "
                                  f"shape [{', '.join('?' if d is None else str(d) for d in value.shape)}]")
            value.const = np.ascontiguousarray(array)
            value.dtype, value.shape = given, tuple(int(d) for d in array.shape)
        frozen = set(self.values)
        graph.inputs = [v for v in graph.inputs if v.name not in frozen]
        return graph


def frozen_summary(values: dict[str, np.ndarray]) -> list[dict]:
    """What the manifest records about frozen inputs: enough to tell which values a build baked in."""
    return [{"name": name, "dtype": str(np.asarray(a).dtype), "shape": [int(d) for d in np.shape(a)],
             "sha256": sha256_bytes(np.ascontiguousarray(a).tobytes())}
            for name, a in sorted(values.items())]


def _dtype_of(array: np.ndarray, input_name: str) -> int:
    try:
        return dtypes.from_numpy(array.dtype)
    except (KeyError, TypeError, ValueError):
        raise CortexError(f"--freeze-input {input_name}: dtype {array.dtype} is not an ONNX tensor type") from None


def _fits(declared, shape) -> bool:
    """Same rank, and every static declared dim equal (named or unknown dims take any size)."""
    return len(declared) == len(shape) and all(not isinstance(d, int) or d == s for d, s in zip(declared, shape))
