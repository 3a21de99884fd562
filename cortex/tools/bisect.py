"""Which CU makes a compiled model disagree with onnxruntime (`cortex verify --bisect`).

A whole-model mismatch says that something is wrong, not where: an error made early travels
through every later CU. So each CU is judged on its own: while the compiled model runs, every CU's
inputs and outputs are copied to the host as the device saw them, and the CU's cu.onnx runs on
onnxruntime with those very inputs. A CU whose outputs then differ beyond the tolerance computes
something else than its ONNX graph says; the first such CU in run order is the culprit. When no CU
diverges on its own while the model does, the small errors of several CUs add up; the CU with the
largest own error (in units of the tolerance) is named instead.

Where the outputs start to drift is a second question, asked of the same run: onnxruntime also runs
the CUs one after the other from the model's inputs, each on the outputs its predecessors had on
onnxruntime, and each CU's outputs in the compiled run are compared with those. The first CU whose
outputs differ there is where the drift starts (`cortex.tools.drift` explains it): the same CU
as the first divergent one for a miscompiled CU, but also a CU that is right on its own inputs
yet amplifies a tiny earlier difference (a dynamic quantization's scale or code).

Each CU's reference is its cu.onnx on onnxruntime as `cortex verify` runs the whole model: where
this machine's onnxruntime saturates uint8 x int8 pair sums (x86 without VNNI) and the CU holds
such a product, `ExactReference` runs it rewritten by `cortex.tools.exact_u8s8`, whose products
are exact, so that a CU computing them exactly is not named for onnxruntime's saturation.

The run is observed at the device boundary: each device the scheduler holds is wrapped so that
`run` hands a copy of the CU's inputs and outputs to the bisection. The scheduler is not changed
and decides what runs exactly as without `--bisect`; a CU it does not run is not judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import onnx
import onnxruntime as ort
from onnx.external_data_helper import load_external_data_for_model

from backends.registry import Device
from backends.registry import device as device_spec
from cortex.runtime.loader import CompiledModel
from cortex.tools import exact_u8s8
from cortex.tools.compare import compare
from ir.errors import CortexError
from ir.fs import confined_path, read_artifact

REFERENCE_DEVICE = "onnxruntime"


@dataclass
class CUCheck:
    """One CU judged on its own inputs: the device's outputs against onnxruntime's."""
    cu: str
    device: str
    op_types: list[str]
    outputs: list[dict]                 # compare() rows, one per CU output
    compared: bool = True               # False: random ops, whose outputs differ by design
    fallback: bool = False              # the CU runs on onnxruntime itself (decompose --fallback)
    exact_u8s8: bool = False            # its reference ran exact_u8s8's rewrite (onnxruntime saturates here)
    quantizes: bool = False             # it quantizes activations at run time (dag.json's "quantizes")
    drift: list[dict] = field(default_factory=list)   # compare() rows against onnxruntime run CU by CU

    @property
    def drifts(self) -> bool:
        return self.compared and not all(row["ok"] for row in self.drift)

    @property
    def ok(self) -> bool:
        return all(row["ok"] for row in self.outputs)

    @property
    def tolerance_ratio(self) -> float:
        return max((row["tolerance_ratio"] for row in self.outputs), default=0.0)

    def to_json(self) -> dict:
        return {"cu": self.cu, "device": self.device, "op_types": self.op_types, "ok": self.ok,
                "compared": self.compared, "fallback": self.fallback, "exact_u8s8": self.exact_u8s8,
                "outputs": self.outputs,
                "drifts": self.drifts, "drift": self.drift}


@dataclass
class CUCase:
    """What reproduces one CU's result: its inputs, onnxruntime's outputs and the device's."""
    cu: dict
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    actual: dict[str, np.ndarray]


@dataclass
class BisectReport:
    checks: list[CUCheck]
    first_divergent: CUCheck | None
    largest_error: CUCheck | None
    model_ok: bool
    first_drifting: CUCheck | None = None     # the first CU whose outputs differ from onnxruntime's chain
    named: CUCase | None = field(default=None, repr=False)   # the case of the CU the report names

    @property
    def verdict(self) -> str:
        if self.first_divergent is not None:
            return "diverges"
        return "agrees" if self.model_ok else "accumulates"

    @property
    def named_check(self) -> CUCheck | None:
        return self.first_divergent or self.largest_error

    def summary(self) -> str:
        """One sentence for the table."""
        if self.first_divergent is not None:
            return f"first CU that diverges on its own inputs: {describe(self.first_divergent)}"
        largest = f"; the largest own error is {describe(self.largest_error)}" if self.largest_error else ""
        if self.model_ok:
            return "no CU diverges on its own inputs" + largest
        return "no CU diverges on its own inputs: the model's error accumulates over several CUs" + largest

    def to_json(self) -> dict:
        named = self.named_check
        return {"verdict": self.verdict, "summary": self.summary(),
                "first_divergent_cu": self.first_divergent.to_json() if self.first_divergent else None,
                "largest_error_cu": self.largest_error.to_json() if self.largest_error else None,
                "named_cu": named.cu if named else None,
                "drift_start_cu": self.first_drifting.cu if self.first_drifting else None,
                "cus": [c.to_json() for c in self.checks]}


def describe(check: CUCheck) -> str:
    errors = ", ".join(f"{r['name']} max abs {r['max_abs_error']:.3g} rel {r['max_rel_error']:.3g}"
                       for r in check.outputs)
    return f"{check.cu} ({', '.join(check.op_types)}) on {check.device}: {errors}"


class Bisection:
    """Attach to a loaded model before it runs; `report()` after the run."""

    def __init__(self, model: CompiledModel, rtol: float, atol: float):
        self.rtol, self.atol = rtol, atol
        self.reference = ExactReference(model.dag, model.path)
        self.checks: list[CUCheck] = []
        self.cases: dict[str, CUCase] = {}
        self.first_divergent: CUCheck | None = None
        self.largest_error: CUCheck | None = None
        self.first_drifting: CUCheck | None = None
        self.chain: dict[str, np.ndarray] = {}     # every CU output as onnxruntime computed it, CU by CU
        devices = model.scheduler.devices
        for name in list(devices):
            devices[name] = ObservedDevice(devices[name], name, self.observe)

    def observe(self, cu: dict, device: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        expected = {k: np.asarray(v) for k, v in self.reference.run(cu, inputs).items()}
        check = CUCheck(cu["id"], device, list(cu.get("op_types", [])),
                        [compare(name, outputs[name], expected[name], self.rtol, self.atol) for name in cu["outputs"]],
                        compared=not cu.get("random", False), fallback=device == REFERENCE_DEVICE,
                        exact_u8s8=cu["id"] in self.reference.rewritten, quantizes=bool(cu.get("quantizes")))
        self.checks.append(check)
        if not check.compared:      # listed with its errors, never judged; the chain goes on from its outputs
            check.outputs = [{**row, "ok": True} for row in check.outputs]
            self.chain.update(outputs)
            return
        self.follow_chain(cu, check, inputs, outputs, expected)
        # A fallback CU runs on onnxruntime already: its own error is onnxruntime against itself.
        if not check.fallback and (self.largest_error is None
                                   or check.tolerance_ratio > self.largest_error.tolerance_ratio):
            self.largest_error = check
        if self.first_divergent is not None:
            return
        # Only the case of the CU the report will name is kept, not every CU's tensors.
        if not check.ok:
            self.first_divergent = check
            self.cases = {check.cu: CUCase(cu, inputs, expected, outputs)}
        elif check is self.largest_error:
            self.cases = {check.cu: CUCase(cu, inputs, expected, outputs)}

    def follow_chain(self, cu: dict, check: CUCheck, inputs: dict, outputs: dict, expected: dict) -> None:
        """Compare the CU's outputs with onnxruntime's on onnxruntime's own earlier results (the model's
        inputs where no CU made the tensor); while those are the inputs it got, that is `expected`."""
        chained = {name: self.chain.get(name, value) for name, value in inputs.items()}
        if any(chained[name] is not inputs[name] for name in inputs):
            chained = {k: np.asarray(v) for k, v in self.reference.run(cu, chained).items()}
        else:
            chained = expected
        check.drift = [compare(name, outputs[name], chained[name], self.rtol, self.atol) for name in cu["outputs"]]
        self.chain.update({name: chained[name] for name in cu["outputs"]})
        if self.first_drifting is None and check.drifts:
            self.first_drifting = check

    def report(self, model_ok: bool) -> BisectReport:
        report = BisectReport(self.checks, self.first_divergent, self.largest_error, model_ok, self.first_drifting)
        named = report.named_check
        report.named = self.cases.get(named.cu) if named else None
        return report


class ExactReference:
    """Each CU's own cu.onnx on onnxruntime, in a session of its own (the onnxruntime device, which
    checks each file's sha256); where this machine's onnxruntime saturates uint8 x int8 pair sums
    and the CU holds such a product, the cu.onnx rewritten by `exact_u8s8` instead, its int8 inputs
    shifted as that rewrite shifts them."""

    def __init__(self, dag: dict, dag_path):
        self.device = device_spec(REFERENCE_DEVICE).open(dag, dag_path)
        self.dag_path = dag_path
        self.rewritten: dict[str, ort.InferenceSession] = {}
        self.plain: set[str] = set()        # CUs whose cu.onnx runs as it is

    def run(self, cu: dict, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.device.load([cu])
        if cu["id"] not in self.plain and cu["id"] not in self.rewritten:
            self._rewrite(cu, inputs)
        if cu["id"] in self.plain:
            return self.device.run(cu, inputs)
        session = self.rewritten[cu["id"]]
        feeds = exact_u8s8.shifted_feeds(inputs, [i.name for i in session.get_inputs()])
        try:
            return dict(zip(cu["outputs"], session.run(cu["outputs"], feeds)))
        except Exception as e:   # onnxruntime raises its own exception types
            raise CortexError(f"{cu['id']} ({', '.join(cu.get('op_types', []))}) failed on onnxruntime "
                              f"(exact u8s8 rewrite): {str(e).strip().splitlines()[0]}") from None

    def _rewrite(self, cu: dict, inputs: dict) -> None:
        if not exact_u8s8.onnxruntime_saturates_u8s8():
            self.plain.add(cu["id"])
            return
        path = confined_path(self.dag_path.parent, cu["path"])     # load() above refused a path that leaves
        model = onnx.load_from_string(read_artifact(path, cu["sha256"], f"{cu['id']} in {self.dag_path}",
                                                    "run 'cortex decompose' and 'cortex build-dag' again"))
        if not exact_u8s8.has_u8s8_candidates(model):
            self.plain.add(cu["id"])
            return
        load_external_data_for_model(model, str(path.parent))
        rewritten, _ = exact_u8s8.exact_u8s8(model, inputs)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.log_severity_level = 1, 3
        self.rewritten[cu["id"]] = ort.InferenceSession(rewritten.SerializeToString(), options,
                                                        providers=["CPUExecutionProvider"])


class ObservedDevice:
    """A device whose every `run` also hands host copies of the CU's inputs (taken before it runs:
    an input may be a view of another CU's memory) and outputs (taken at once: an output may be a
    view of this CU's memory, overwritten when it runs again) to `observe`."""

    def __init__(self, inner: Device, name: str, observe):
        self.inner, self.device_name, self.observe = inner, name, observe

    def run(self, cu: dict, inputs: dict) -> dict:
        copies = {name: self.inner.to_host(tensor) for name, tensor in inputs.items()}
        results = self.inner.run(cu, inputs)
        self.observe(cu, self.device_name, copies, {name: self.inner.to_host(t) for name, t in results.items()})
        return results

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
