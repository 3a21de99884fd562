"""The Open Inference Protocol codec of `cortex serve`: every KServe v2 datatype the models use, as
JSON and as binary tensor data, and the request mistakes it names."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from cortex.serve.codec import DATATYPES, RequestError, decode_request, encode_response

OUTPUTS = [{"name": "y", "dtype": "float32", "shape": [2]}]


def values(dtype: str) -> np.ndarray:
    if dtype == "bool":
        return np.array([[True, False, True], [False, False, True]])
    return np.arange(-2, 4).reshape(2, 3).astype(dtype) if np.dtype(dtype).kind != "u" else \
        np.arange(6).reshape(2, 3).astype(dtype)


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_each_datatype_decodes_from_json_and_from_binary(datatype):
    dtype = DATATYPES[datatype]
    x = values(dtype)
    spec = [{"name": "x", "dtype": dtype, "shape": [2, 3]}]
    as_json = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": datatype,
                           "data": x.astype(np.float64 if x.dtype.kind == "f" else x.dtype).reshape(-1).tolist()}]}
    decoded = decode_request(json.dumps(as_json).encode(), None, spec, OUTPUTS)
    assert decoded.feeds["x"].dtype == np.dtype(dtype) and np.array_equal(decoded.feeds["x"], x)
    header = json.dumps({"inputs": [{"name": "x", "shape": [2, 3], "datatype": datatype,
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    decoded = decode_request(header + x.tobytes(), str(len(header)), spec, OUTPUTS)
    assert decoded.feeds["x"].dtype == np.dtype(dtype) and np.array_equal(decoded.feeds["x"], x)
    assert decoded.outputs is None and decoded.binary_outputs == set()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "int8", "uint8", "bool"])
def test_outputs_encode_as_json_or_binary(dtype):
    y = values(dtype)
    body, length = encode_response({"y": y}, set(), {"model_name": "m"})
    assert length is None
    entry = json.loads(body)["outputs"][0]
    assert entry["datatype"] == {v: k for k, v in DATATYPES.items()}[dtype] and entry["shape"] == [2, 3]
    assert np.array_equal(np.array(entry["data"]).astype(dtype).reshape(2, 3), y)
    body, length = encode_response({"y": y}, {"y"}, {"model_name": "m"})
    assert json.loads(body[:length])["outputs"][0]["parameters"] == {"binary_data_size": y.nbytes}
    assert np.array_equal(np.frombuffer(body[length:], y.dtype).reshape(2, 3), y)


def test_binary_data_output_makes_every_output_binary_unless_one_says_otherwise():
    spec = [{"name": "x", "dtype": "float32", "shape": [1]}]
    outputs = [{"name": "a", "dtype": "float32", "shape": [1]}, {"name": "b", "dtype": "float32", "shape": [1]}]
    request = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.5]}],
               "parameters": {"binary_data_output": True}}
    assert decode_request(json.dumps(request).encode(), None, spec, outputs).binary_outputs == {"a", "b"}
    request["outputs"] = [{"name": "b"}, {"name": "a", "parameters": {"binary_data": False}}]
    decoded = decode_request(json.dumps(request).encode(), None, spec, outputs)
    assert decoded.outputs == ["b", "a"] and decoded.binary_outputs == {"b"}


@pytest.mark.parametrize("data, datatype, fragment", [
    ([1.5, 2, 3, 4, 5, 6], "INT64", "its data must be integers"),
    ([1, 0, 1, 0, 1, 0], "BOOL", "its data must be true or false"),
    ([300, 0, 0, 0, 0, 0], "UINT8", "outside the range of UINT8"),
    ([-1, 0, 0, 0, 0, 0], "UINT8", "outside the range of UINT8"),
    ([True, 0, 0, 0, 0, 0], "FP32", "its data must be numbers"),
    ("123456", "FP32", "'data' must be a list"),
])
def test_bad_values_are_named(data, datatype, fragment):
    spec = [{"name": "x", "dtype": DATATYPES[datatype], "shape": [2, 3]}]
    request = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": datatype, "data": data}]}
    with pytest.raises(RequestError, match="input 'x'") as caught:
        decode_request(json.dumps(request).encode(), None, spec, OUTPUTS)
    assert fragment in str(caught.value) and caught.value.status == 400


def test_binary_data_no_input_claims_is_refused():
    spec = [{"name": "x", "dtype": "float32", "shape": [1]}]
    header = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}).encode()
    with pytest.raises(RequestError, match="4 bytes of binary data that no input claims"):
        decode_request(header + b"\0" * 4, str(len(header)), spec, OUTPUTS)


def test_bfloat16_is_numpys_ml_dtypes():
    assert np.dtype(DATATYPES["BF16"]) == np.dtype(ml_dtypes.bfloat16)
