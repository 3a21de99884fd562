"""Element types. The IR keeps ONNX's `TensorProto.DataType` numbers so round trips are exact."""

import numpy as np
import onnx
from onnx import TensorProto, helper

UNDEFINED = TensorProto.UNDEFINED
FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64


def to_numpy(dtype: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(dtype))


def from_numpy(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def name(dtype: int) -> str:
    if dtype == UNDEFINED:
        return "undefined"
    return helper.tensor_dtype_to_string(dtype).removeprefix("TensorProto.").lower()


def itemsize(dtype: int) -> int:
    """Bytes per element; sub-byte types (int4, float4) round up to one byte."""
    if dtype == TensorProto.STRING:
        return 8
    return max(1, to_numpy(dtype).itemsize)


def from_name(text: str) -> int:
    try:
        return getattr(TensorProto, text.upper())
    except AttributeError:
        raise ValueError(f"unknown dtype {text!r}") from None


__all__ = ["UNDEFINED", "FLOAT", "INT64", "NUMPY_NAMES", "to_numpy", "from_numpy", "name", "itemsize", "from_name", "onnx"]


def _numpy_names() -> frozenset[str]:
    names = set()
    for value in TensorProto.DataType.values():
        try:
            names.add(to_numpy(value).name)
        except (KeyError, TypeError, ValueError):
            pass     # UNDEFINED and types numpy cannot hold
    names.discard("object")
    return frozenset(names)


# The spelling of every element type in manifest.json and dag.json (numpy's: float32, bool...).
NUMPY_NAMES = _numpy_names()
