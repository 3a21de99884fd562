"""`cortex serve` under faults: a CU that traps fails only its own request (500) while concurrent
and later requests succeed, and SIGTERM lets a slow request in flight finish before the server
exits 0. The faults come from a test-only module placed as the Relu CU (serve_cases.HOSTILE_RELU_WAT)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from runtime_cases import build, two_output_model
from serve_cases import Server, output_array, plant_hostile_relu, tensor
from testdata import run_onnxruntime

TRAP = -2000.0            # x[0] below -1000: the hostile Relu executes `unreachable`
SLOW = 1004.0             # x[0] above 1000: it spins 4 * 10^9 iterations (about a second or two)
RUNAWAY = 1e6             # 10^15 iterations: only a deadline ends it


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    dag_path = build(two_output_model(), tmp_path_factory.mktemp("faults") / "tiny")
    relu = plant_hostile_relu(dag_path)
    # A fixed deadline well above the slow request's seconds: the SIGTERM test needs it to finish.
    server = Server(dag_path, "--workers", "2", "--cu-timeout-ms", "60000")
    yield server, dag_path, relu
    server.stop()


def sample(seed: int, first: float | None = None) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)
    if first is not None:
        x[0, 0] = first
    return x


def check(document: dict, dag_path, x: np.ndarray) -> None:
    want = run_onnxruntime(dag_path.parent / "two_outputs.onnx", {"x": x})
    for name in ("y1", "y2"):
        np.testing.assert_allclose(output_array(document, name), want[name], rtol=1e-5, atol=1e-5)


def test_a_cu_trap_fails_only_that_request(hostile):
    server, dag_path, relu = hostile
    good = [sample(seed) for seed in range(4)]
    answers: list[tuple[int, dict]] = []
    lock = threading.Lock()

    def client(x: np.ndarray, count: int) -> None:
        connection = server.connection()
        try:
            for _ in range(count):
                answer = server.infer({"inputs": [tensor("x", x)]}, connection=connection)
                with lock:
                    answers.append((answer, x))
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(x, 10)) for x in good]
    for thread in threads:
        thread.start()
    status, document = server.infer({"inputs": [tensor("x", sample(9, TRAP))]})
    for thread in threads:
        thread.join(timeout=60)
    assert status == 500
    assert document["error"].startswith("the model failed on this request: ")
    assert f"{relu} (Relu) trapped" in document["error"] and "unreachable" in document["error"]
    assert len(answers) == 40
    for (code, answer), x in answers:      # the concurrent requests were not affected
        assert code == 200, answer
        check(answer, dag_path, x)
    for seed in range(4):                  # nor later ones, on either instance
        x = sample(20 + seed)
        code, answer = server.infer({"inputs": [tensor("x", x)]})
        assert code == 200, answer
        check(answer, dag_path, x)
    metrics = server.metrics()
    assert metrics['cortex_sandbox_traps_total{model="tiny"}'] == 1
    assert metrics['cortex_requests_total{model="tiny",status="500"}'] == 1


def test_a_runaway_cu_is_stopped_by_the_servers_default_deadline(hostile):
    _, dag_path, relu = hostile
    server = Server(dag_path)                 # deadlines from each CU's cost: at least 1 s
    try:
        status, document = server.infer({"inputs": [tensor("x", sample(40, RUNAWAY))]})
        assert status == 500
        assert f"{relu} (Relu) timed out" in document["error"], document
        x = sample(41)
        code, answer = server.infer({"inputs": [tensor("x", x)]})
        assert code == 200, answer
        check(answer, dag_path, x)
        assert server.metrics()['cortex_sandbox_timeouts_total{model="tiny"}'] == 1
    finally:
        server.stop()


def test_sigterm_drains_the_request_in_flight_and_exits_0(hostile):
    server, dag_path, _ = hostile
    x = sample(30, SLOW)
    answers = []
    slow = threading.Thread(target=lambda: answers.append(server.infer({"inputs": [tensor("x", x)]})))
    slow.start()
    time.sleep(0.5)                        # the slow CU is running by now
    assert slow.is_alive(), "the slow request finished before SIGTERM: it cannot show the drain"
    code, err = server.terminate(timeout=60)
    slow.join(timeout=60)
    assert code == 0, err
    assert "Traceback" not in err
    status, document = answers[0]
    assert status == 200, document
    check(document, dag_path, x)
