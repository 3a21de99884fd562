"""A `cortex serve` subprocess on 127.0.0.1 for the serve tests, and plain HTTP helpers.

Each server is the installed `cortex serve` on `--port 0`; the port is read from its startup
line. Every wait is bounded."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import selectors
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import wasmtime
from onnx import TensorProto, helper

from cli_helpers import cortex_command

START_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 30


class Server:
    def __init__(self, dag_path: Path, *options):
        self.process = subprocess.Popen(cortex_command("serve", dag_path, "--port", "0", *options),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
        line = _first_line(self.process, START_TIMEOUT_S)
        if "http://127.0.0.1:" not in line:
            self.process.kill()
            raise AssertionError(f"cortex serve did not start: {line!r} {self.process.stderr.read().decode()}")
        self.port = int(line.rsplit("http://127.0.0.1:", 1)[1].split()[0])
        self.model = line.split()[1]

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                connection: http.client.HTTPConnection | None = None) -> tuple[int, dict, bytes]:
        """(status, headers with lower-case names, body) of one request."""
        own = connection is None
        connection = connection or self.connection()
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            if own:
                connection.close()

    def infer(self, document: dict, headers: dict | None = None, model: str | None = None,
              connection: http.client.HTTPConnection | None = None) -> tuple[int, dict]:
        status, _, body = self.request("POST", f"/v2/models/{model or self.model}/infer",
                                       json.dumps(document).encode(), {"Content-Type": "application/json",
                                                                       **(headers or {})}, connection)
        return status, json.loads(body)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by their full name with labels, e.g. 'cortex_requests_total{...}'."""
        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        samples = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def terminate(self, timeout: float = 30) -> tuple[int, str]:
        """SIGTERM, then the exit code and stderr once it has exited."""
        self.process.send_signal(signal.SIGTERM)
        try:
            _, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        return self.process.returncode, err.decode()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.terminate()


def tensor(name: str, array: np.ndarray, datatype: str = "FP32") -> dict:
    return {"name": name, "shape": list(array.shape), "datatype": datatype, "data": array.reshape(-1).tolist()}


def output_array(document: dict, name: str) -> np.ndarray:
    entry = next(o for o in document["outputs"] if o["name"] == name)
    return np.array(entry["data"], dtype=np.float32).reshape(entry["shape"])


def _first_line(process: subprocess.Popen, timeout: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n") and time.monotonic() < deadline:
        if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        chunk = os.read(process.stdout.fileno(), 1)
        if not chunk:
            break
        line += chunk
    selector.close()
    return line.decode()


# A stand-in for the Relu CU of runtime_cases.two_output_model (x: float32[4, 8] at offset 0, h at
# offset 128): the same exports and the same results, plus two test-only behaviours chosen by x[0]:
# below -1000 it executes `unreachable` (a trap), above 1000 it spins (x[0] - 1000) * 10^9 loop
# iterations first (a slow CU).
HOSTILE_RELU_WAT = """
(module
  (memory (export "memory") 1)
  (func (export "run")
    (local $i i32) (local $n i64)
    (if (f32.lt (f32.load (i32.const 0)) (f32.const -1000)) (then unreachable))
    (if (f32.gt (f32.load (i32.const 0)) (f32.const 1000))
      (then
        (local.set $n (i64.trunc_f32_u (f32.mul (f32.sub (f32.load (i32.const 0)) (f32.const 1000))
                                                (f32.const 1000000000))))
        (block $done (loop $spin
          (br_if $done (i64.eqz (local.get $n)))
          (local.set $n (i64.sub (local.get $n) (i64.const 1)))
          (br $spin)))))
    (loop $relu
      (f32.store offset=128 (local.get $i) (f32.max (f32.load (local.get $i)) (f32.const 0)))
      (local.set $i (i32.add (local.get $i) (i32.const 4)))
      (br_if $relu (i32.lt_u (local.get $i) (i32.const 128))))))
"""


def plant_hostile_relu(dag_path: Path) -> str:
    """Replace the Relu CU's module by HOSTILE_RELU_WAT and record its sha256 in dag.json; its id."""
    dag = json.loads(dag_path.read_text())
    cu = next(cu for cu in dag["cus"] if cu["op_types"] == ["Relu"])
    record = cu["artifacts"]["wasm"]
    assert record["memory"]["memory_bytes"] <= 65536 and record["memory"]["inputs"][0]["offset"] == 0
    module = wasmtime.wat2wasm(HOSTILE_RELU_WAT)
    (dag_path.parent / record["path"]).write_bytes(module)
    record["sha256"], record["bytes"] = hashlib.sha256(module).hexdigest(), len(module)
    dag_path.write_text(json.dumps(dag, indent=2))
    return cu["id"]


def typed_model():
    """Inputs INT64, BOOL and UINT8; outputs FP32, BOOL, INT64 and FP16: y = Where(m, a, u) as
    float32, z = Not(m), w = a + a, yh = y as float16."""
    nodes = [helper.make_node("Cast", ["a"], ["af"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["u"], ["uf"], to=TensorProto.FLOAT),
             helper.make_node("Where", ["m", "af", "uf"], ["y"]), helper.make_node("Not", ["m"], ["z"]),
             helper.make_node("Add", ["a", "a"], ["w"]), helper.make_node("Cast", ["y"], ["yh"], to=TensorProto.FLOAT16)]
    tensors = {"a": TensorProto.INT64, "m": TensorProto.BOOL, "u": TensorProto.UINT8, "y": TensorProto.FLOAT,
               "z": TensorProto.BOOL, "w": TensorProto.INT64, "yh": TensorProto.FLOAT16}
    values = {name: helper.make_tensor_value_info(name, kind, [2, 3]) for name, kind in tensors.items()}
    graph = helper.make_graph(nodes, "typed", [values[n] for n in ("a", "m", "u")],
                              [values[n] for n in ("y", "z", "w", "yh")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
