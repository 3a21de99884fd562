"""`cortex serve`: the Open Inference Protocol endpoints, JSON and binary tensors, tritonclient,
the per-request headers, /metrics, and every bad request answered with a 4xx while the server keeps
serving; each server the installed script on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from cli_helpers import assert_one_line_error, run_cli
from cortex.runtime.trace import validate_trace
from runtime_cases import build, two_output_model
from serve_cases import Server, output_array, tensor
from testdata import run_onnxruntime

MAX_BODY_BYTES = 16384
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # x marked repeating, so that the metrics can count cache hits (a dag.json that marks nothing caches nothing).
    dag_path = build(two_output_model(), tmp_path_factory.mktemp("served") / "tiny", cache_inputs=("x",))
    server = Server(dag_path, "--workers", "2", "--max-body-mb", str(MAX_BODY_BYTES / (1 << 20)),
                    "--read-timeout-s", str(READ_TIMEOUT_S))
    yield server, dag_path
    server.stop()


def reference(dag_path, x: np.ndarray) -> dict[str, np.ndarray]:
    return run_onnxruntime(dag_path.parent / "two_outputs.onnx", {"x": x})


def sample(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)


def assert_serves(server: Server, dag_path) -> None:
    """The server still answers a good request, with onnxruntime's numbers."""
    x = sample(99)
    status, document = server.infer({"inputs": [tensor("x", x)]})
    assert status == 200, document
    np.testing.assert_allclose(output_array(document, "y2"), reference(dag_path, x)["y2"], rtol=1e-5, atol=1e-5)


def test_health_and_metadata(served):
    server, _ = served
    assert server.model == "tiny"          # the name of dag.json's folder
    for path, want in (("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
                       ("/v2/models/tiny/ready", {"name": "tiny", "ready": True}),
                       ("/v2/models/tiny/versions/1/ready", {"name": "tiny", "ready": True})):
        status, _, body = server.request("GET", path)
        assert (status, json.loads(body)) == (200, want), path
    status, _, body = server.request("GET", "/v2")
    assert status == 200 and json.loads(body)["extensions"] == ["binary_tensor_data"]
    for path in ("/v2/models/tiny", "/v2/models/tiny/versions/1"):
        status, _, body = server.request("GET", path)
        assert status == 200
        assert json.loads(body) == {"name": "tiny", "versions": ["1"], "platform": "cortex_dag",
                                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [4, 8]}],
                                    "outputs": [{"name": "y1", "datatype": "FP32", "shape": [4, 8]},
                                                {"name": "y2", "datatype": "FP32", "shape": [4, 8]}]}


def test_json_infer_matches_onnxruntime_and_returns_requested_outputs(served):
    server, dag_path = served
    x = sample(1)
    want = reference(dag_path, x)
    status, document = server.infer({"id": "r1", "inputs": [tensor("x", x)]})
    assert status == 200 and document["id"] == "r1" and document["model_name"] == "tiny"
    assert [o["name"] for o in document["outputs"]] == ["y1", "y2"]
    for name in ("y1", "y2"):
        np.testing.assert_allclose(output_array(document, name), want[name], rtol=1e-5, atol=1e-5)
    nested = {"name": "x", "shape": [4, 8], "datatype": "FP32", "data": x.tolist()}   # nested lists are allowed
    status, document = server.infer({"inputs": [nested], "outputs": [{"name": "y1"}]},
                                    model="tiny/versions/1")
    assert status == 200 and [o["name"] for o in document["outputs"]] == ["y1"]
    np.testing.assert_allclose(output_array(document, "y1"), want["y1"], rtol=1e-5, atol=1e-5)


def test_policy_and_trace_headers(served):
    server, dag_path = served
    x = sample(2)
    status, document = server.infer({"inputs": [tensor("x", x)], "outputs": [{"name": "y1"}]},
                                    headers={"X-Cortex-Policy": "strict", "X-Cortex-Trace": "true"})
    assert status == 200
    trace = json.loads(document["parameters"]["cortex_trace"])
    validate_trace(trace)
    dag = json.loads(dag_path.read_text())
    assert trace["policy"] == "strict" and trace["activated_cus"] == dag["order"]   # strict runs every CU
    status, document = server.infer({"inputs": [tensor("x", x)], "outputs": [{"name": "y1"}]},
                                    headers={"X-Cortex-Trace": "true"})
    trace = json.loads(document["parameters"]["cortex_trace"])
    assert trace["policy"] == "balanced" and len(trace["activated_cus"]) < len(dag["order"])
    status, document = server.infer({"inputs": [tensor("x", x)]}, headers={"X-Cortex-Policy": "offline"})
    assert status == 200 and "parameters" not in document
    np.testing.assert_allclose(output_array(document, "y2"), reference(dag_path, x)["y2"], rtol=1e-5, atol=1e-5)


def test_binary_tensors_both_ways(served):
    server, dag_path = served
    x = sample(3)
    header = json.dumps({"inputs": [{"name": "x", "shape": [4, 8], "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "y2", "parameters": {"binary_data": True}}, {"name": "y1"}]}).encode()
    status, headers, body = server.request("POST", "/v2/models/tiny/infer", header + x.tobytes(),
                                           {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body
    length = int(headers["inference-header-content-length"])
    document = json.loads(body[:length])
    y2 = next(o for o in document["outputs"] if o["name"] == "y2")
    assert y2["parameters"] == {"binary_data_size": 128} and len(body) == length + 128
    want = reference(dag_path, x)
    np.testing.assert_allclose(np.frombuffer(body[length:], np.float32).reshape(4, 8), want["y2"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(output_array(document, "y1"), want["y1"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_works_unchanged(served, binary):
    server, dag_path = served
    client = triton.InferenceServerClient(url=server.url, connection_timeout=30, network_timeout=30)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
        assert client.get_model_metadata("tiny")["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [4, 8]}]
        x = sample(4)
        feed = triton.InferInput("x", [4, 8], "FP32")
        feed.set_data_from_numpy(x, binary_data=binary)
        want = reference(dag_path, x)
        result = client.infer("tiny", [feed], outputs=[triton.InferRequestedOutput("y1", binary_data=binary)])
        np.testing.assert_allclose(result.as_numpy("y1"), want["y1"], rtol=1e-5, atol=1e-5)
        assert result.as_numpy("y2") is None
        result = client.infer("tiny", [feed])      # no outputs named: all of them, as binary
        for name in ("y1", "y2"):
            np.testing.assert_allclose(result.as_numpy(name), want[name], rtol=1e-5, atol=1e-5)
        result = client.infer("tiny", [feed], headers={"X-Cortex-Policy": "strict", "X-Cortex-Trace": "true"})
        assert json.loads(result.get_response()["parameters"]["cortex_trace"])["policy"] == "strict"
        with pytest.raises(InferenceServerException, match="unknown model 'other'"):
            client.infer("other", [feed])
    finally:
        client.close()


BAD_REQUESTS = {
    "malformed JSON": (b'{"inputs": [', {}, 400, "not valid JSON"),
    "not an object": (b"[1, 2]", {}, 400, "must be a JSON object"),
    "wrong shape": ({"inputs": [{"name": "x", "shape": [8, 4], "datatype": "FP32", "data": [0.0] * 32}]}, {}, 400,
                    "input 'x' has shape [8, 4], the model expects [4, 8]"),
    "too few values": ({"inputs": [{"name": "x", "shape": [4, 8], "datatype": "FP32", "data": [0.0] * 31}]}, {}, 400,
                       "input 'x' has 31 values"),
    "wrong dtype": ({"inputs": [{"name": "x", "shape": [4, 8], "datatype": "INT64", "data": [0] * 32}]}, {}, 400,
                    "input 'x' has datatype 'INT64', the model expects FP32"),
    "strings as data": ({"inputs": [{"name": "x", "shape": [4, 8], "datatype": "FP32", "data": ["a"] * 32}]}, {},
                        400, "its data must be numbers"),
    "unknown input": ({"inputs": [tensor("x", np.zeros((4, 8), np.float32)), tensor("z", np.zeros(1, np.float32))]},
                      {}, 400, "unknown input 'z'"),
    "missing input": ({"inputs": []}, {}, 400, "missing input 'x' (FP32[4, 8])"),
    "unknown output": ({"inputs": [tensor("x", np.zeros((4, 8), np.float32))], "outputs": [{"name": "y3"}]}, {}, 400,
                       "unknown output 'y3'"),
    "bad binary size": ({"inputs": [{"name": "x", "shape": [4, 8], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 64}}]}, {}, 400, "binary_data_size is 64"),
    "unknown policy": ({"inputs": [tensor("x", np.zeros((4, 8), np.float32))]}, {"X-Cortex-Policy": "fast"}, 400,
                       "X-Cortex-Policy 'fast'"),
    "bad trace flag": ({"inputs": [tensor("x", np.zeros((4, 8), np.float32))]}, {"X-Cortex-Trace": "maybe"}, 400,
                       "X-Cortex-Trace 'maybe': expected true or false"),
    "bad header length": (b"{}", {"Inference-Header-Content-Length": "99"}, 400, "Inference-Header-Content-Length"),
    "compressed body": (b"{}", {"Content-Encoding": "gzip"}, 415, "Content-Encoding 'gzip'"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_gets_one_clear_4xx_and_the_server_keeps_serving(served, case):
    server, dag_path = served
    body, headers, want_status, fragment = BAD_REQUESTS[case]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = server.request("POST", "/v2/models/tiny/infer", raw, headers)
    assert status == want_status
    message = json.loads(answer)["error"]
    assert fragment in message and "\n" not in message and "Traceback" not in message
    assert_serves(server, dag_path)


def test_unknown_model_and_version_are_404(served):
    server, dag_path = served
    status, document = server.infer({"inputs": [tensor("x", sample(5))]}, model="other")
    assert status == 404 and document["error"] == "unknown model 'other': this server serves 'tiny'"
    status, _, body = server.request("GET", "/v2/models/tiny/versions/2")
    assert status == 404 and "no version '2'" in json.loads(body)["error"]
    status, _, body = server.request("GET", "/v2/nothing-here")
    assert status == 404 and json.loads(body)["error"] == "GET /v2/nothing-here: Not Found"
    assert_serves(server, dag_path)


def test_a_body_over_the_limit_is_413_before_it_is_read(served):
    server, dag_path = served
    status, _, body = server.request("POST", "/v2/models/tiny/infer", b" " * (MAX_BODY_BYTES + 1))
    assert status == 413 and "over the limit of 16384 bytes (--max-body-mb)" in json.loads(body)["error"]
    # Chunked, so no Content-Length announces it: refused once the bytes read pass the limit,
    # while the client has not finished sending.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            sock.sendall(b"%x\r\n%s\r\n" % (8000, b" " * 8000))
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 413") and b"passes the limit of 16384 bytes" in answer
    assert_serves(server, dag_path)


def test_a_slow_client_gets_408_without_blocking_others(served):
    server, dag_path = served
    answers = []

    def slow_client():
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"in")
            answers.append(_read_until_closed(sock))

    thread = threading.Thread(target=slow_client)
    start = time.monotonic()
    thread.start()
    time.sleep(0.2)
    for _ in range(5):                     # served while the slow client holds its connection
        assert_serves(server, dag_path)
    served_by = time.monotonic() - start
    thread.join(timeout=30)
    assert not thread.is_alive() and answers[0].startswith(b"HTTP/1.1 408")
    assert b"(--read-timeout-s)" in answers[0]
    assert served_by < time.monotonic() - start   # the others were answered before the slow one gave up


def test_metrics_count_requests_latency_and_cus(served):
    server, dag_path = served
    before = server.metrics()
    x = sample(6)
    for _ in range(3):
        status, _ = server.infer({"inputs": [tensor("x", x)]})
        assert status == 200
    server.infer({"inputs": []})
    after = server.metrics()
    label = '{model="tiny",status="200"}'

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew(f"cortex_requests_total{label}") == 3
    assert grew('cortex_requests_total{model="tiny",status="400"}') == 1
    assert grew('cortex_request_latency_seconds_count{model="tiny"}') == 4
    cus = len(json.loads(dag_path.read_text())["cus"])
    activated, cache_hits = grew('cortex_cus_total{model="tiny",outcome="activated"}'), \
        grew('cortex_cache_hits_total{model="tiny"}')
    # The same input three times on two instances: every CU runs or is a cache hit.
    assert activated + cache_hits == 3 * cus and cache_hits >= cus
    assert grew('cortex_cus_total{model="tiny",outcome="skipped"}') == cache_hits
    assert after['cortex_resident_bytes{model="tiny"}'] > 0
    for name in ("cortex_evictions_total", "cortex_sandbox_traps_total", "cortex_memory_evicted_bytes_total"):
        assert f'{name}{{model="tiny"}}' in after


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_serve_refuses_bad_options_in_one_line(served, tmp_path):
    server, dag_path = served
    code, _, err = run_cli(["serve", tmp_path / "missing" / "dag.json", "--port", "0"])
    assert_one_line_error(code, err, "dag.json")
    code, _, err = run_cli(["serve", dag_path, "--port", str(server.port)])
    assert_one_line_error(code, err, f"--port {server.port}: cannot listen there")


def test_a_memory_budget_keeps_each_instance_within_it_and_answers_correctly(tmp_path):
    dag_path = build(two_output_model(), tmp_path / "tiny")
    dag = json.loads(dag_path.read_text())
    pages = [-(-cu["artifacts"]["wasm"]["memory"]["memory_bytes"] // 65536) * 65536 for cu in dag["cus"]]
    assert len(pages) > 1
    budget_mb = max(pages) / (1 << 20)       # room for the largest CU alone: every other CU is evicted for it
    server = Server(dag_path, "--memory-budget", repr(budget_mb), "--policy", "strict")
    try:
        for seed in range(3):
            x = sample(seed)
            status, document = server.infer({"inputs": [tensor("x", x)]}, headers={"X-Cortex-Trace": "true"})
            assert status == 200, document
            for name in ("y1", "y2"):
                np.testing.assert_allclose(output_array(document, name), reference(dag_path, x)[name],
                                           rtol=1e-5, atol=1e-5)
            memory = json.loads(document["parameters"]["cortex_trace"])["memory"]
            assert memory["budget_bytes"] == max(pages)
            assert memory["peak_resident_bytes"] <= max(pages)
        metrics = server.metrics()
        assert metrics['cortex_memory_loaded_bytes_total{model="tiny"}'] > 0
        assert metrics['cortex_evictions_total{model="tiny"}'] > 0
    finally:
        server.stop()
