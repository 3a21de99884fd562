"""Targets and devices come from one registry. A device registered here, by the test alone, runs
a compiled model through `cortex.load` with no edit anywhere else: it runs each CU's own cu.onnx
with onnxruntime, as a fallback device would."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import cortex
from backends.registry import DeviceSpec, devices, register_device, targets, unregister_device
from bench.conformance.devices import device_names as harness_devices
from cortex.runtime import device_names
from ir.errors import CortexError
from testdata import assert_values_close, sample_model
from wasm_cases import compile_pipeline


class OnnxruntimePerCU:
    """Each CU's cu.onnx in its own onnxruntime session."""

    name = "onnxruntime-per-cu"

    def __init__(self, dag: dict, dag_path: Path):
        self.folder = Path(dag_path).parent
        self.sessions: dict[str, ort.InferenceSession] = {}
        self.runs: list[str] = []

    def load(self, cus: list[dict]) -> None:
        for cu in cus:
            self.sessions[cu["id"]] = ort.InferenceSession(str(self.folder / cu["path"]),
                                                           providers=["CPUExecutionProvider"])

    def run(self, cu: dict, inputs: dict) -> dict:
        self.runs.append(cu["id"])
        return dict(zip(cu["outputs"], self.sessions[cu["id"]].run(cu["outputs"], inputs)))

    def to_device(self, array):
        return array

    def to_host(self, tensor):
        return np.array(tensor)

    def resident_bytes(self, cu_id: str) -> int:
        return 0


@pytest.fixture
def test_device():
    register_device(DeviceSpec(name=OnnxruntimePerCU.name, artifact=None, open=OnnxruntimePerCU))
    yield OnnxruntimePerCU.name
    unregister_device(OnnxruntimePerCU.name)


def test_a_device_registered_by_a_test_runs_a_compiled_model(tmp_path, test_device):
    case = sample_model("transformer_block")
    dag_path = compile_pipeline(case.path, tmp_path, input_shapes=case.input_shapes, dims=case.dims,
                                min_cu_size=64, max_cu_depth=2)
    model = cortex.load(dag_path, device=test_device)
    assert test_device in device_names()
    got = model.run(case.inputs)
    assert_values_close(got, case.outputs, rtol=1e-5, atol=1e-6)
    assert model.device.runs == model.dag["order"] and len(model.trace) == len(model.dag["cus"]) > 1
    assert model.trace_document()["device"] == test_device


def test_the_built_in_targets_and_devices_are_registered():
    assert {"wasm", "cuda"} <= set(targets())
    assert {"wasm", "cuda", "cuda-sim"} <= set(devices())
    assert set(harness_devices()) == set(device_names())


def test_an_unknown_device_names_the_known_ones(tmp_path):
    with pytest.raises(CortexError, match="unknown device 'tpu'.*cuda-sim"):
        cortex.load(tmp_path / "dag.json", device="tpu")
