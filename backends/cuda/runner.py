"""Running one compiled CU: its launch list over its parameter layout, on `cuda` or `cuda-sim`.

The record (what compile-cuda writes into dag.json, `cus[i].artifacts.cuda`) says which kernels to
launch in which order with which geometry, and the parameter layout every kernel shares: the CU's
inputs, its outputs, the weights blob and the scratch space. The runner allocates outputs and scratch
once, uploads the weights once, and for each run binds the given input tensors and launches (a CU
whose record says `module: false` has no kernel and only hands back its empty outputs). On the
GPU, tensors are `DeviceBuffer`s and stay on the device (one CU's output buffer is the next one's
input); on cuda-sim they are numpy arrays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from backends.cuda.content_addressed import read_weights
from backends.cuda.sim import SimModule
from ir.bounds import pad_into
from ir.errors import CortexError


class CuRunner:
    def __init__(self, device, record: dict, folder: Path, *, seed: int = 0, host_threads: int = 1,
                 owner: str = "its record"):
        """`device`: a CudaDevice, or None for cuda-sim. `folder`: where the record's files are;
        `owner` names the CU in the error for a missing or modified weights file."""
        self.device = device
        self.record = record
        self.params = record["params"]
        self.launches = record["launches"]
        self.seed, self.host_threads = seed, host_threads
        weights = read_weights(record, folder, owner)
        scratch_bytes = max(1, record["scratch_bytes"])
        signatures = {launch["kernel"]: ["ptr"] * len(self.params) for launch in self.launches}
        if not record.get("module", True):
            # No kernel (every output is empty): nothing to load, and the launch list is empty.
            self.module = self.weights = self.scratch = None
        elif device is None:
            self.module = SimModule(folder / record["source"]["file"])
            self.weights, self.scratch = weights, np.zeros(scratch_bytes, np.uint8)
        else:
            cubins = {arch: (folder / entry["file"]).read_bytes() for arch, entry in record["cubins"].items()}
            ptx = (folder / record["ptx"]["file"]).read_bytes()
            self.module = device.load_module(cubins, ptx, signatures)
            self.weights, self.scratch = device.upload(weights), device.alloc(scratch_bytes)
        self.outputs = {p["name"]: self._alloc(p) for p in self.params if p["kind"] == "output"}
        # Data-dependent lengths (ir/bounds.py): bounded tensor -> (axis, its length param's name).
        self.bounds = {name: (b["axis"], b["length"]) for name, b in record.get("bounds", {}).items()}
        self.lengths = {p["name"]: self._alloc(p) for p in self.params if p["kind"] == "length"}
        self._staged: dict = {}      # GPU: bounded input name -> the buffer it is padded into
        self.resident_bytes = (len(weights) + scratch_bytes + sum(p["bytes"] for p in self.params if p["kind"] == "output")
                               if self.module is not None else 0)

    def _alloc(self, param: dict):
        if self.device is None:
            return np.empty(param["shape"], np.dtype(param["dtype"]))
        return self.device.alloc(param["bytes"])

    def run(self, inputs: dict) -> dict:
        """Launch every kernel; returns the output tensors (numpy on cuda-sim, device buffers on cuda)."""
        args = []
        for p in self.params:
            if p["kind"] == "input":
                if p["name"] not in inputs:
                    raise CortexError(f"CU input {p['name']!r} was not given")
                value = inputs[p["name"]]
                if p["name"] in self.bounds:
                    value = self._padded(p, value)
                if self.device is None:
                    value = np.ascontiguousarray(value, dtype=np.dtype(p["dtype"]))
                    if value.size * value.itemsize != p["bytes"]:
                        raise CortexError(f"CU input {p['name']!r}: expected shape {p['shape']}, got {list(value.shape)}")
                args.append(value)
            elif p["kind"] == "output":
                args.append(self.outputs[p["name"]])
            elif p["kind"] == "length":
                args.append(self.lengths[p["name"]])
            else:
                args.append(self.weights if p["kind"] == "weights" else self.scratch)
        for launch in self.launches:
            self.module.kernel(launch["kernel"]).launch(launch["grid"], launch["block"], launch.get("shared_bytes", 0),
                                                        args, seed=self.seed, host_threads=self.host_threads)
        return dict(self.outputs)

    def _padded(self, param: dict, real: np.ndarray):
        """A bounded input, given at its real shape on the host, as the padded buffer the kernels
        read; its length goes into its companion."""
        axis, length_param = self.bounds[param["name"]]
        padded = np.zeros(param["shape"], np.dtype(param["dtype"]))
        length = np.array([pad_into(padded, real, axis)], np.int32)
        if self.device is None:
            self.lengths[length_param][...] = length
            return padded
        self.device.upload(length, self.lengths[length_param])
        if param["name"] not in self._staged:
            self._staged[param["name"]] = self.device.alloc(param["bytes"])
        return self.device.upload(padded, self._staged[param["name"]])

    def output_lengths(self) -> dict[str, tuple[int, int]]:
        """Each bounded output's (axis, real length) after a run."""
        found = {}
        for name, (axis, length_param) in self.bounds.items():
            if name in self.outputs:
                held = self.lengths[length_param]
                length = held if self.device is None else self.device.download(held, (1,), "int32")
                found[name] = (axis, int(np.asarray(length).reshape(-1)[0]))
        return found
