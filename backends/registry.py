"""The registry of targets and devices: the one place the CLI, the runtime and the conformance
harness ask what exists.

A *target* turns one CU's optimised graph into artifact files and a record for dag.json
(`cus[i].artifacts[target.artifact]`); `cortex compile-<name>` is generated from it. A *device*
runs the artifacts of one target: it loads CUs, runs one CU at a time and unloads them when told,
and never decides what runs or what stays loaded (that is the scheduler's job, in cortex/runtime).

Each folder under backends/ registers what it provides when it is imported (its `__init__.py`);
`targets()` and `devices()` import every such folder first, so adding a target is adding a folder,
and adding a device is one module that calls `register_device`. Tests may register their own.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from ir.errors import CortexError
from ir.graph import Graph


class Device(Protocol):
    """Runs the artifacts of one CU at a time. Tensors it returns may live on the device (a GPU
    buffer) or in a CU's memory (a view valid until that CU runs again); `to_host` copies them out.
    A device whose class sets `concurrent_runs = True` lets different CUs run on different threads
    at once (the threaded scheduler); others run every CU on the thread that loaded them.
    A device may also define `reads_in_place(cu, name, tensor) -> bool` (the wasm device does):
    whether `cu` reads its input `name` where `tensor` already lies, so the trace counts only the
    bytes copied between CUs; a device without it is not counted."""

    name: str

    def load(self, cus: list[dict]) -> None:
        """Make these CUs runnable: check each artifact's sha256, compile or instantiate it."""

    def run(self, cu: dict, inputs: dict) -> dict:
        """Run one loaded CU on its inputs (by name); returns its outputs by name."""

    def to_device(self, array: np.ndarray):
        """A model input as this device's tensor."""

    def to_host(self, tensor) -> np.ndarray:
        """A tensor as a numpy array the caller owns."""

    def resident_bytes(self, cu_id: str) -> int:
        """Memory the loaded CU holds (its instance, weights and scratch); 0 when it is not loaded."""

    def footprint(self, cu: dict) -> int:
        """What `resident_bytes` will be once `cu` is loaded, known from dag.json without loading
        it: a memory budget decides what to evict before anything is loaded."""

    def unload(self, cu_id: str) -> int:
        """Release a loaded CU (a later `load` makes it runnable again); the bytes it held, 0 if
        it was not loaded. Tensors it returned that live in its memory are invalid afterwards."""


class SandboxedDevice(Device, Protocol):
    """A device whose spec says `sandboxed`: opened with a `SandboxLimits` (backends/limits.py)
    as a third argument, it enforces them and counts what it stopped."""

    def sandbox_events(self) -> dict[str, int]:
        """Traps, timeouts, memory limit hits and rebuilt CUs since it was opened (`SANDBOX_COUNTERS`)."""


class HostTensors:
    """For devices whose tensors are numpy arrays of this process (a CU's outputs may be views of
    its memory, valid until it runs again: `to_host` copies)."""

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_host(self, tensor: np.ndarray) -> np.ndarray:
        return np.array(tensor)


@dataclass(frozen=True)
class BuiltCU:
    """What a target makes of one CU: files by name, and the record for dag.json."""
    files: dict[str, bytes]
    record: dict


@dataclass(frozen=True)
class TargetVariant:
    """A variant a target builds from the exact CU's graph with other options of its own, rather than
    with narrowed weights (`compile-cuda --variants tf32`: float32 weights, contractions on tensor cores)."""
    build: Callable[[Graph, object, str], BuiltCU | None]   # (graph, options, variant id); None: nothing changes
    check: Callable[[object], None] = lambda options: None  # fail before any work (options that exclude it)
    description: str = ""                                    # for `--variants`'s help


@dataclass(frozen=True)
class Target:
    name: str                                   # "wasm": `cortex compile-wasm`
    artifact: str                               # key under cus[i].artifacts in dag.json
    options: type                               # a dataclass; its fields are the CLI options
    build: Callable[[Graph, object, str], BuiltCU]       # (graph, options, cu id)
    place: Callable[[dict, str], dict]          # (record, output folder relative to dag.json) -> dag record
    summarize: Callable[[dict[str, dict], object], dict]    # (records by CU, options) -> summary figures
    description: str = ""
    jobs: int = 1                               # CUs built at once (threads; compilers are subprocesses)
    check: Callable[[object], None] = lambda options: None   # fail before any work (no compiler...)
    lowering: str = "loops"                     # which of the op registry's lowerings its renderer reads
    # The external compiler the artifacts also depend on ("nvcc 13.0"), part of the compile cache's key.
    toolchain: Callable[[object], str] = lambda options: ""
    # Builds whose CUs depend on one another (one model-level memory, `compile-wasm --memory shared`):
    # `links(options)` says so, and `link(options, graphs by CU id, manifest)` gives each CU's options.
    links: Callable[[object], bool] = lambda options: False
    link: Callable[[object, dict, dict], dict] | None = None
    # The target runs 8-bit integer GEMMs faster than float32 ones: an int8 variant's products of more
    # than two rows then quantize their activations at run time to run on it (passes/narrow_weights.py);
    # elsewhere they stay weight-only.
    integer_gemm: bool = False
    # Variant precisions only this target builds (`--variants`, beside the narrow-weight ones every target has).
    variants: dict[str, TargetVariant] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    artifact: str | None                        # which target's artifacts it runs (None: the cu.onnx files)
    open: Callable[[dict, Path], Device]        # (dag, path of dag.json) -> Device
    unavailable: Callable[[], str | None] = lambda: None   # why it cannot run here, in one line
    description: str = ""
    compile_options: dict = field(default_factory=dict)   # target options (as text) that suit this device
    sandboxed: bool = False                     # open takes a SandboxLimits; the device is a SandboxedDevice
    # A device that spreads CUs over others: (dag) -> the rule (cu record) -> the device that runs it.
    place: Callable[[dict], Callable[[dict], str]] | None = None


_TARGETS: dict[str, Target] = {}
_DEVICES: dict[str, DeviceSpec] = {}
_discovered = False
_MISSING: dict[str, str] = {}     # backend folder -> the missing Python package that kept it out
_PROJECT_PACKAGES = {"backends", "codegen", "cortex", "ir", "passes"}


def register_target(target: Target) -> Target:
    _TARGETS[target.name] = target
    return target


def register_device(spec: DeviceSpec) -> DeviceSpec:
    _DEVICES[spec.name] = spec
    return spec


def unregister_device(name: str) -> None:
    _DEVICES.pop(name, None)


def _discover() -> None:
    """Import every backend folder once, so that each registers itself."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if module.ispkg:
            try:
                importlib.import_module(f"{__package__}.{module.name}")
            except ModuleNotFoundError as e:
                # A backend whose Python package is not installed (wasmtime on a GPU machine) is
                # absent; the others still work, and asking for it says what is missing.
                if not e.name or e.name.split(".")[0] in _PROJECT_PACKAGES:
                    raise
                _MISSING[module.name] = e.name.split(".")[0]


def _unknown(kind: str, name: str, known) -> CortexError:
    if name in _MISSING:
        return CortexError(f"{kind} {name!r} needs the Python package {_MISSING[name]!r}, which is not installed")
    return CortexError(f"unknown {kind} {name!r}: expected one of {', '.join(known)}")


def targets() -> dict[str, Target]:
    _discover()
    return dict(_TARGETS)


def devices() -> dict[str, DeviceSpec]:
    _discover()
    return dict(_DEVICES)


def target(name: str) -> Target:
    known = targets()
    if name not in known:
        raise _unknown("target", name, known)
    return known[name]


def device(name: str) -> DeviceSpec:
    known = devices()
    if name not in known:
        raise _unknown("device", name, known)
    return known[name]
