"""`cortex serve` on a model compiled for several input shapes: metadata with -1 on the varying
axis and the compiled shapes, every compiled shape served (JSON and binary tensors, through
tritonclient) with onnxruntime's numbers, a shape no specialization takes answered with one 400
line naming the compiled ones while the server keeps serving, `--pad-to-bucket` padding a smaller
batch up to the next bucket, and the per-specialization metrics that show each instance loading
only the specializations its requests picked.

The model is specialized_builds' chain (MatMul -> Add -> Tanh layers over x[batch, 16]): every row
is computed on its own, so padding the batch with rows of zeros and slicing them off is sound."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from cli_helpers import assert_one_line_error, run_cli
from serve_cases import Server, output_array, tensor
from specialized_builds import WIDTH, build_in_process, chain_model
from tritonclient.utils import InferenceServerException

from cortex.serve.codec import RequestError, decode_request

RTOL, ATOL = 1e-4, 1e-5
BATCHES = (2, 4, 8)
COMPILED = "batch=2 (x=2x16); batch=4 (x=4x16); batch=8 (x=8x16)"
OUTPUT = "t3"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """(dag.json of the chain built for batch 2, 4 and 8, the source model)."""
    root = tmp_path_factory.mktemp("servespec")
    model = chain_model(root / "chain.onnx")
    return build_in_process(model, root / "out", "--dim", "batch=" + ",".join(map(str, BATCHES))), model


@pytest.fixture(scope="module")
def served(bundle):
    server = Server(bundle[0], "--workers", "2")
    yield server, bundle[1]
    server.stop()


@pytest.fixture(scope="module")
def padding(bundle):
    server = Server(bundle[0], "--pad-to-bucket", "batch", "--pad-value", "0", "--workers", "2",
                    "--specializations", "eager")
    yield server, bundle[1]
    server.stop()


def sample(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([batch, seed]).standard_normal((batch, WIDTH)).astype(np.float32)


def reference(model, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def specialization_samples(server: Server, metric: str) -> dict[str, float]:
    prefix = f'{metric}{{model="{server.model}",specialization="'
    return {name[len(prefix):-2]: value for name, value in server.metrics().items() if name.startswith(prefix)}


def test_metadata_has_minus_one_where_the_shapes_differ_and_lists_the_compiled_shapes(served, padding):
    server, _ = served
    status, _, body = server.request("GET", f"/v2/models/{server.model}")
    assert status == 200
    shapes = {"cortex_shapes": ";".join(f"{b}x{WIDTH}" for b in BATCHES)}
    assert json.loads(body) == {
        "name": "out", "versions": ["1"], "platform": "cortex_dag",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, WIDTH], "parameters": shapes}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, WIDTH], "parameters": shapes}],
        "parameters": {"cortex_specializations": "batch=2;batch=4;batch=8"}}
    padded, _ = padding
    client = triton.InferenceServerClient(url=padded.url, connection_timeout=30, network_timeout=30)
    try:
        metadata = client.get_model_metadata("out")
    finally:
        client.close()
    assert metadata["inputs"][0]["shape"] == [-1, WIDTH]
    assert metadata["parameters"] == {"cortex_specializations": "batch=2;batch=4;batch=8",
                                      "cortex_pad_to_bucket": "batch"}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_every_compiled_shape_is_served_with_onnxruntimes_numbers(served, binary):
    server, model = served
    client = triton.InferenceServerClient(url=server.url, connection_timeout=30, network_timeout=30)
    try:
        for batch in BATCHES:
            x = sample(batch, seed=int(binary))
            feed = triton.InferInput("x", [batch, WIDTH], "FP32")
            feed.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("out", [feed], outputs=[triton.InferRequestedOutput(OUTPUT, binary_data=binary)])
            np.testing.assert_allclose(result.as_numpy(OUTPUT), reference(model, x), rtol=RTOL, atol=ATOL)
    finally:
        client.close()


BAD_SHAPES = {
    "a batch never compiled": ([3, WIDTH], "no shape specialization matches the inputs (x=3x16)"),
    "another rank": ([2, WIDTH, 1], "no shape specialization matches the inputs (x=2x16x1)"),
    "a negative dim": ([-2, WIDTH], "'shape' must be a list of non-negative integers, the model expects [-1, 16]"),
}


@pytest.mark.parametrize("case", BAD_SHAPES, ids=list(BAD_SHAPES))
def test_a_shape_no_specialization_takes_is_one_400_line_and_the_next_request_is_served(served, case):
    server, model = served
    shape, fragment = BAD_SHAPES[case]
    count = max(int(np.prod(shape)), 0)
    status, document = server.infer({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                                 "data": [0.5] * count}]})
    assert status == 400 and fragment in document["error"] and "\n" not in document["error"]
    if case != "a negative dim":
        assert f"model 'out' was compiled for: {COMPILED}" in document["error"]
        assert "dag.json" not in document["error"]           # the server's paths are its own
    x = sample(4, seed=7)
    status, document = server.infer({"inputs": [tensor("x", x)]})
    assert status == 200, document
    np.testing.assert_allclose(output_array(document, OUTPUT), reference(model, x), rtol=RTOL, atol=ATOL)


def test_byte_counts_are_still_checked_against_the_requests_own_shape(served):
    server, _ = served
    x = sample(4)
    header = json.dumps({"inputs": [{"name": "x", "shape": [4, WIDTH], "datatype": "FP32",
                                     "parameters": {"binary_data_size": sample(2).nbytes}}]}).encode()
    status, _, body = server.request("POST", "/v2/models/out/infer", header + x.tobytes()[:sample(2).nbytes],
                                     {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "binary_data_size is 128, a FP32[4, 16] tensor is 256 bytes" in json.loads(body)["error"]
    status, document = server.infer({"inputs": [{"name": "x", "shape": [4, WIDTH], "datatype": "FP32",
                                                 "data": [0.0] * (2 * WIDTH)}]})
    assert status == 400 and "input 'x' has 32 values, its shape [4, 16] holds 64" in document["error"]


def test_tritonclient_sees_the_400_as_an_error_naming_the_compiled_shapes(served):
    server, _ = served
    client = triton.InferenceServerClient(url=server.url, connection_timeout=30, network_timeout=30)
    try:
        feed = triton.InferInput("x", [5, WIDTH], "FP32")
        feed.set_data_from_numpy(sample(5))
        with pytest.raises(InferenceServerException, match="was compiled for: batch=2"):
            client.infer("out", [feed])
    finally:
        client.close()


def test_pad_to_bucket_pads_a_smaller_batch_to_the_next_bucket_and_slices_the_outputs_back(padding):
    server, model = padding
    before = specialization_samples(server, "cortex_specialization_requests_total")
    client = triton.InferenceServerClient(url=server.url, connection_timeout=30, network_timeout=30)
    try:
        for batch, binary in ((3, True), (5, False), (1, True), (8, False)):
            x = sample(batch, seed=3)
            feed = triton.InferInput("x", [batch, WIDTH], "FP32")
            feed.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("out", [feed], outputs=[triton.InferRequestedOutput(OUTPUT, binary_data=binary)])
            assert result.as_numpy(OUTPUT).shape == (batch, WIDTH)
            np.testing.assert_allclose(result.as_numpy(OUTPUT), reference(model, x), rtol=RTOL, atol=ATOL)
    finally:
        client.close()
    after = specialization_samples(server, "cortex_specialization_requests_total")
    assert {name: after[name] - before[name] for name in after} == {"batch=2": 1, "batch=4": 1, "batch=8": 2}
    status, document = server.infer({"inputs": [tensor("x", sample(9))]})
    assert status == 400 and "\n" not in document["error"]
    assert f"no shape specialization matches or holds the inputs padded along batch (x=9x16); model 'out' was " \
           f"compiled for: {COMPILED}" in document["error"]
    x = sample(6)
    status, document = server.infer({"inputs": [tensor("x", x)]})
    assert status == 200, document
    np.testing.assert_allclose(output_array(document, OUTPUT), reference(model, x), rtol=RTOL, atol=ATOL)


def test_each_instance_loads_only_the_specializations_its_requests_picked(bundle):
    dag, model = bundle
    server = Server(dag, "--workers", "2")
    try:
        assert specialization_samples(server, "cortex_specialization_instances") == \
            {"batch=2": 0, "batch=4": 0, "batch=8": 0}
        x = sample(4)
        status, document = server.infer({"inputs": [tensor("x", x)]})
        assert status == 200, document
        np.testing.assert_allclose(output_array(document, OUTPUT), reference(model, x), rtol=RTOL, atol=ATOL)
        assert specialization_samples(server, "cortex_specialization_instances") == \
            {"batch=2": 0, "batch=4": 1, "batch=8": 0}
        assert specialization_samples(server, "cortex_specialization_requests_total") == \
            {"batch=2": 0, "batch=4": 1, "batch=8": 0}
        assert server.metrics()['cortex_resident_bytes{model="out"}'] > 0
    finally:
        server.stop()


def test_eager_instances_load_every_specialization_before_serving(padding):
    server, _ = padding        # --workers 2 --specializations eager
    assert specialization_samples(server, "cortex_specialization_instances") == \
        {"batch=2": 2, "batch=4": 2, "batch=8": 2}


def test_a_bucket_the_specializations_lack_is_one_error_at_startup(bundle):
    code, _, err = run_cli(["serve", bundle[0], "--port", "0", "--pad-to-bucket", "seq"])
    assert_one_line_error(code, err, "--pad-to-bucket seq: not a dim or input of the specializations", "batch")


def test_the_codec_asks_the_model_about_the_shapes_before_reading_any_data():
    asked = []

    def only_batch_two(shapes):
        asked.append(shapes)
        if shapes["x"][0] != 2:
            raise RequestError("not batch 2")

    inputs = [{"name": "x", "dtype": "float32", "shape": [-1, WIDTH]}]
    outputs = [{"name": OUTPUT, "dtype": "float32", "shape": [-1, WIDTH]}]
    huge = {"inputs": [{"name": "x", "shape": [10 ** 12, WIDTH], "datatype": "FP32", "data": [1.0]}]}
    with pytest.raises(RequestError, match="not batch 2"):
        decode_request(json.dumps(huge).encode(), None, inputs, outputs, only_batch_two)
    x = sample(2)
    decoded = decode_request(json.dumps({"inputs": [tensor("x", x)]}).encode(), None, inputs, outputs, only_batch_two)
    assert asked == [{"x": [10 ** 12, WIDTH]}, {"x": [2, WIDTH]}] and np.array_equal(decoded.feeds["x"], x)
