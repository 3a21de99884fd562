"""The Open Inference Protocol's tensors (KServe v2, Triton's HTTP API) to numpy and back.

A request is JSON, or JSON followed by raw tensor bytes when the client uses the binary tensor
data extension: the `Inference-Header-Content-Length` header says where the JSON ends, each input
with a `binary_data_size` parameter takes that many bytes from the rest, in input order. Outputs go
back as binary when the request asks (`binary_data` on the output, or `binary_data_output` on the
request; tritonclient asks for binary when it names no outputs), as JSON lists otherwise.

Every mistake in a request is a `RequestError`: one line naming the input or output and what the
model expects, answered with a 4xx by the app.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes  # noqa: F401  (registers numpy's bfloat16 dtype, BF16's)
import numpy as np

from cortex.serve.specializations import tensor_parameters

# KServe v2 datatype -> numpy dtype name, as dag.json spells dtypes.
DATATYPES = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "FP32": "float32", "FP64": "float64", "BF16": "bfloat16",
}
DTYPES = {dtype: datatype for datatype, dtype in DATATYPES.items()}
HEADER_LENGTH = "inference-header-content-length"


class RequestError(Exception):
    """A request the model cannot run as sent; `status` is the HTTP status it is answered with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class InferRequest:
    id: str | None
    feeds: dict[str, np.ndarray]
    outputs: list[str] | None                 # None: all of the model's outputs
    binary_outputs: set[str] = field(default_factory=set)


def datatype_of(dtype: str) -> str:
    """The protocol's name for a dag.json dtype (BYTES for a dtype it has no name for)."""
    return DTYPES.get(dtype, "BYTES")


def tensor_metadata(spec: dict) -> dict:
    metadata = {"name": spec["name"], "datatype": datatype_of(spec["dtype"]), "shape": list(spec["shape"])}
    parameters = tensor_parameters(spec)
    return {**metadata, "parameters": parameters} if parameters else metadata


def decode_request(body: bytes, header_length: str | None, inputs: list[dict], outputs: list[dict],
                   check_shapes: Callable[[dict[str, list[int]]], None] | None = None) -> InferRequest:
    """The feeds and requested outputs of an infer request's body, checked against the model's
    `inputs` and `outputs` (dag.json's specs). Without `check_shapes` each input must have its
    spec's shape; with it (a model of several shapes, whose specs say -1 where they differ) the
    model judges the request's shapes as a whole, raising a RequestError for shapes it cannot run,
    before any tensor's data is read."""
    json_bytes, binary = _split_body(body, header_length)
    try:
        document = json.loads(json_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(document, dict):
        raise RequestError("the request body must be a JSON object with an 'inputs' list")
    expected = {spec["name"]: spec for spec in inputs}
    given = document.get("inputs")
    if not isinstance(given, list) or not all(isinstance(entry, dict) for entry in given):
        raise RequestError("'inputs' must be a list of tensors, each an object with name, shape, datatype and data")
    shapes: dict[str, list[int]] = {}
    for entry in given:
        name = entry.get("name")
        if name not in expected:
            raise RequestError(f"unknown input {name!r}: the model's inputs are {', '.join(map(repr, expected))}")
        if name in shapes:
            raise RequestError(f"input {name!r} is given twice")
        shapes[name] = _tensor_shape(entry, expected[name], exact=check_shapes is None)
    missing = [name for name in expected if name not in shapes]
    if missing:
        spec = expected[missing[0]]
        raise RequestError(f"missing input {missing[0]!r} ({datatype_of(spec['dtype'])}{list(spec['shape'])})")
    if check_shapes is not None:
        check_shapes({name: shapes[name] for name in expected})
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    for entry in given:
        name = entry["name"]
        feeds[name], offset = _decode_tensor(entry, expected[name], shapes[name], binary, offset)
    if offset != len(binary):
        raise RequestError(f"the body has {len(binary) - offset} bytes of binary data that no input claims")
    requested, binary_outputs = _requested_outputs(document, outputs)
    request_id = document.get("id")
    return InferRequest(id=request_id if isinstance(request_id, str) else None, feeds=feeds,
                        outputs=requested, binary_outputs=binary_outputs)


def encode_response(results: dict[str, np.ndarray], binary_outputs: set[str], head: dict) -> tuple[bytes, int | None]:
    """The response body and, when some output is binary, the length of its JSON header."""
    tensors, chunks = [], []
    for name, value in results.items():
        array = np.ascontiguousarray(value)
        tensor = {"name": name, "datatype": datatype_of(str(array.dtype)), "shape": list(array.shape)}
        if name in binary_outputs:
            chunk = array.tobytes()
            tensor["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            tensor["data"] = _json_values(array)
        tensors.append(tensor)
    header = json.dumps({**head, "outputs": tensors}, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    try:
        length = int(header_length)
    except ValueError:
        length = -1
    if not 0 <= length <= len(body):
        raise RequestError(f"Inference-Header-Content-Length {header_length!r} is not a length within the body's "
                           f"{len(body)} bytes")
    return body[:length], body[length:]


def _tensor_shape(entry: dict, spec: dict, exact: bool) -> list[int]:
    """An input's datatype checked and its shape read (checked against the spec's when `exact`)."""
    name, dtype, shape = spec["name"], spec["dtype"], list(spec["shape"])
    datatype = entry.get("datatype")
    if datatype != datatype_of(dtype):
        raise RequestError(f"input {name!r} has datatype {datatype!r}, the model expects {datatype_of(dtype)}")
    given_shape = entry.get("shape")
    if not isinstance(given_shape, list) or \
            not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in given_shape):
        raise RequestError(f"input {name!r}: 'shape' must be a list of non-negative integers, the model expects "
                           f"{shape}")
    if exact and given_shape != shape:
        raise RequestError(f"input {name!r} has shape {given_shape}, the model expects {shape}")
    return given_shape


def _decode_tensor(entry: dict, spec: dict, shape: list[int], binary: bytes, offset: int) -> tuple[np.ndarray, int]:
    """One input's values, of its checked `shape`: its bytes from `binary` at `offset`, or its JSON data."""
    name, dtype, datatype = spec["name"], spec["dtype"], entry["datatype"]
    count = math.prod(shape)
    parameters = entry.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        nbytes = count * np.dtype(dtype).itemsize
        if size != nbytes:
            raise RequestError(f"input {name!r}: binary_data_size is {size}, a {datatype}{shape} tensor is {nbytes} bytes")
        if offset + nbytes > len(binary):
            raise RequestError(f"input {name!r}: the body ends before its {nbytes} bytes of binary data")
        array = np.frombuffer(binary, dtype=dtype, count=count, offset=offset).reshape(shape)
        return array, offset + nbytes
    if "data" not in entry:
        raise RequestError(f"input {name!r} has neither 'data' nor a binary_data_size parameter")
    return _from_json(name, entry["data"], dtype, shape, count), offset


def _from_json(name: str, data, dtype: str, shape: list[int], count: int) -> np.ndarray:
    flat = _flatten(data)
    if flat is None:
        raise RequestError(f"input {name!r}: 'data' must be a list of numbers{' or booleans' if dtype == 'bool' else ''}")
    if len(flat) != count:
        raise RequestError(f"input {name!r} has {len(flat)} values, its shape {shape} holds {count}")
    kind = np.dtype(dtype).kind
    if kind == "b":
        if not all(isinstance(v, bool) for v in flat):
            raise RequestError(f"input {name!r} is BOOL: its data must be true or false")
    elif any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in flat):
        raise RequestError(f"input {name!r}: its data must be numbers")
    elif kind in "iu" and not all(isinstance(v, int) for v in flat):
        raise RequestError(f"input {name!r} is {datatype_of(dtype)}: its data must be integers")
    try:
        return np.array(flat, dtype=dtype).reshape(shape)
    except OverflowError:
        raise RequestError(f"input {name!r}: a value lies outside the range of {datatype_of(dtype)}") from None


def _flatten(data) -> list | None:
    """Row-major values of a flat or nested JSON list (the protocol allows both); None if not a list."""
    if not isinstance(data, list):
        return None
    flat, stack = [], [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def _requested_outputs(document: dict, outputs: list[dict]) -> tuple[list[str] | None, set[str]]:
    known = [spec["name"] for spec in outputs]
    parameters = document.get("parameters") or {}
    all_binary = isinstance(parameters, dict) and parameters.get("binary_data_output") is True
    entries = document.get("outputs")
    if entries is None:
        return None, set(known) if all_binary else set()
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise RequestError("'outputs' must be a list of objects, each with a name")
    names, binary = [], set()
    for entry in entries:
        name = entry.get("name")
        if name not in known:
            raise RequestError(f"unknown output {name!r}: the model's outputs are {', '.join(map(repr, known))}")
        names.append(name)
        entry_parameters = entry.get("parameters") or {}
        wants = entry_parameters.get("binary_data") if isinstance(entry_parameters, dict) else None
        if wants is True or (wants is None and all_binary):
            binary.add(name)
    if not names:
        raise RequestError(f"'outputs' is empty: name at least one of {', '.join(map(repr, known))}")
    return list(dict.fromkeys(names)), binary


def _json_values(array: np.ndarray) -> list:
    if array.dtype.kind == "f" and array.dtype != np.float64:
        array = array.astype(np.float64)    # bfloat16 and float16 have no tolist of their own numbers
    return array.reshape(-1).tolist()
