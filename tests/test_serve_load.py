"""`cortex serve` under load on loopback: 8 concurrent clients x 200 requests each, every response
checked against onnxruntime, 0 errors, p50/p99 latency printed, the server's RSS stable."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from runtime_cases import build, two_output_model
from serve_cases import Server, output_array, tensor
from testdata import run_onnxruntime

CLIENTS = 8
REQUESTS_PER_CLIENT = 200
DISTINCT_INPUTS = 64        # some repeat, so result-cache hits are part of the load
RSS_GROWTH_ALLOWED = 0.05


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    # x marked repeating: a dag.json that marks nothing caches nothing, and the load repeats inputs.
    dag_path = build(two_output_model(), tmp_path_factory.mktemp("load") / "tiny", cache_inputs=("x",))
    server = Server(dag_path, "--workers", "2")
    yield server, dag_path
    server.stop()


def test_concurrent_clients_get_onnxruntime_results_with_no_errors_and_stable_rss(loaded):
    server, dag_path = loaded
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(DISTINCT_INPUTS)]
    wanted = [run_onnxruntime(dag_path.parent / "two_outputs.onnx", {"x": x}) for x in inputs]
    bodies = [json.dumps({"inputs": [tensor("x", x)]}).encode() for x in inputs]
    latencies: list[float] = []
    errors: list[str] = []
    done = [0]
    lock = threading.Lock()

    def client(index: int) -> None:
        connection = server.connection()          # keep-alive: one connection per client
        try:
            for n in range(REQUESTS_PER_CLIENT):
                k = (index * REQUESTS_PER_CLIENT + n * 7) % DISTINCT_INPUTS
                start = time.perf_counter()
                status, _, body = server.request("POST", f"/v2/models/{server.model}/infer", bodies[k],
                                                 {"Content-Type": "application/json"}, connection)
                seconds = time.perf_counter() - start
                problem = None
                if status != 200:
                    problem = f"status {status}: {body[:200]!r}"
                else:
                    document = json.loads(body)
                    for name in ("y1", "y2"):
                        if not np.allclose(output_array(document, name), wanted[k][name], rtol=1e-5, atol=1e-5):
                            problem = f"{name} differs from onnxruntime for input {k}"
                with lock:
                    latencies.append(seconds)
                    done[0] += 1
                    if problem:
                        errors.append(problem)
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    total = CLIENTS * REQUESTS_PER_CLIENT
    samples: list[tuple[int, int]] = []     # (requests done, server RSS in KiB)
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        samples.append((done[0], server.rss_kib()))
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    wall = time.perf_counter() - start
    assert not any(t.is_alive() for t in threads), "the load did not finish within 120 s"

    assert errors == [] and len(latencies) == total
    p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
    print(f"\n{CLIENTS} clients x {REQUESTS_PER_CLIENT} requests: p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
          f"{total / wall:.0f} requests/s, RSS {samples[0][1]} -> {server.rss_kib()} KiB")
    first = [rss for n, rss in samples if n <= total // 4]
    last = [rss for n, rss in samples if n >= 3 * total // 4]
    assert first and last
    assert max(last) <= max(first) * (1 + RSS_GROWTH_ALLOWED), (max(first), max(last))
    metrics = server.metrics()
    assert metrics[f'cortex_requests_total{{model="{server.model}",status="200"}}'] == total
    assert metrics[f'cortex_request_latency_seconds_count{{model="{server.model}"}}'] == total
    assert metrics[f'cortex_cache_hits_total{{model="{server.model}"}}'] > 0
