"""`cortex serve` with INT64, BOOL, UINT8, FP32 and FP16 tensors, through tritonclient in JSON and
binary, against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton

from runtime_cases import build
from serve_cases import Server, typed_model
from testdata import run_onnxruntime

FEEDS = {"a": np.array([[1, -2, 3], [4, 5, -6]], np.int64),
         "m": np.array([[True, False, True], [False, True, False]]),
         "u": np.array([[0, 7, 255], [3, 4, 5]], np.uint8)}
DATATYPES = {"a": "INT64", "m": "BOOL", "u": "UINT8"}


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    dag_path = build(typed_model(), tmp_path_factory.mktemp("typed") / "typed")
    server = Server(dag_path)
    yield server, dag_path
    server.stop()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_every_datatype_round_trips_through_tritonclient(typed, binary):
    server, dag_path = typed
    want = run_onnxruntime(dag_path.parent / "typed.onnx", FEEDS)
    client = triton.InferenceServerClient(url=server.url, connection_timeout=30, network_timeout=30)
    try:
        feeds = []
        for name, value in FEEDS.items():
            feed = triton.InferInput(name, list(value.shape), DATATYPES[name])
            feed.set_data_from_numpy(value, binary_data=binary)
            feeds.append(feed)
        outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("y", "z", "w", "yh")]
        result = client.infer("typed", feeds, outputs=outputs)
        metadata = {o["name"]: o["datatype"] for o in client.get_model_metadata("typed")["outputs"]}
    finally:
        client.close()
    assert metadata == {"y": "FP32", "z": "BOOL", "w": "INT64", "yh": "FP16"}
    for name in ("y", "z", "w", "yh"):
        got = result.as_numpy(name)
        assert got.dtype == want[name].dtype and np.array_equal(got, want[name]), name
