"""One node-test case: onnxruntime's verdict on the original, then Cortex's, classified.

Outcomes: "passed"; "failed" (wrong result, with the largest errors); "unsupported" (a clear
CortexError while decomposing or compiling: a limitation Cortex reports); "crashed" (anything else,
or a CortexError while running: a compiled model must run); "ort-cannot-run" (onnxruntime fails or
disagrees with the reference: the case says nothing about Cortex); "out-of-scope".
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from bench.conformance.cases import describe_case, parameter_inputs, tolerances
from bench.conformance.devices import compile_for_device
from cortex.commands.decompose import decompose_model
from cortex.dag import build_dag
from cortex.options import parse_input_shapes
from cortex.runtime import load
from ir.errors import CortexError
from ir.fs import write_bytes_atomically
from samples.node_tests import load_node_test

# The refusals a parameter fed as a graph input causes: a lowering that needs it constant
# (ir/loops/builder.py), and a shape that its value decides (passes/infer_shapes.py).
NEEDS_CONSTANT = ("must be a constant", "cannot infer a static shape")

OUTCOMES = ("passed", "failed", "unsupported", "crashed", "ort-cannot-run", "out-of-scope")


@dataclass
class CaseResult:
    name: str
    op: str
    outcome: str
    why: str = ""
    stage: str = ""           # where Cortex stopped: decompose, build-dag, compile, run, compare
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        # Without the timing: the committed docs/conformance.json then changes only where results do.
        return {k: v for k, v in asdict(self).items() if v not in (None, "", {}) and k != "seconds"}


def run_case(name: str, device: str) -> CaseResult:
    start = time.perf_counter()
    case = load_node_test(name)
    model = onnx.load(case.path, load_external_data=False)
    info = describe_case(model)
    result = CaseResult(name, info.op, "out-of-scope", info.out_of_scope or "")
    if info.out_of_scope is None:
        ort_problem = onnxruntime_problem(case)
        if ort_problem:
            result.outcome, result.why = "ort-cannot-run", ort_problem
        else:
            _run_through_cortex(case, device, result)
            if result.outcome == "unsupported" and any(text in result.why for text in NEEDS_CONSTANT):
                _retry_with_frozen_parameters(case, model, device, result)
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def onnxruntime_problem(case) -> str | None:
    """None when onnxruntime runs the original model and reproduces the reference outputs."""
    ort.set_default_logger_severity(4)    # its kernel failures are recorded, not printed
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.intra_op_num_threads = 1      # the harness runs cases in parallel already
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            session = ort.InferenceSession(str(case.path), opts, providers=["CPUExecutionProvider"])
            names = [o.name for o in session.get_outputs()]
            quiet = ort.RunOptions()
            quiet.log_severity_level = 4
            got = dict(zip(names, session.run(None, case.inputs, quiet)))
    except Exception as e:  # onnxruntime raises its own exception types
        return f"onnxruntime cannot run it: {first_line(e)}"
    problem = compare_outputs(case.name, got, case.outputs)
    return f"onnxruntime disagrees with the reference: {problem[0]}" if problem else None


def _retry_with_frozen_parameters(case, model: onnx.ModelProto, device: str, result: CaseResult) -> None:
    """A deployment feeding fixed op parameters freezes them (`--freeze-input`); the computation under
    test still runs in Cortex. Kept as refused when nothing qualifies or no model input would remain."""
    frozen = {name: case.inputs[name] for name in parameter_inputs(model, case.inputs)
              if isinstance(case.inputs.get(name), np.ndarray)}
    if not frozen or len(frozen) == len(case.inputs):
        return
    retry = CaseResult(result.name, result.op, "unsupported")
    _run_through_cortex(case, device, retry, frozen)
    retry.extra["frozen_parameters"] = sorted(frozen)
    result.__dict__.update({k: v for k, v in retry.__dict__.items() if k != "seconds"})


def _run_through_cortex(case, device: str, result: CaseResult, frozen: dict | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="cortex-conformance-") as tmp:
        out = Path(tmp)
        stage = "decompose"
        try:
            # Bound like a user would: --input-shape for each input the model does not fix itself,
            # through the option's own parser (so a shape the CLI cannot express fails as it would there).
            frozen = frozen or {}
            shapes = parse_input_shapes([f"{k}={_shape_text(v)}" for k, v in case.inputs.items()
                                         if isinstance(v, np.ndarray) and k not in static_inputs(case.path)
                                         and k not in frozen])
            decompose_model(case.path, out / "cus", input_shapes=shapes, frozen_inputs=frozen)
            stage = "build-dag"
            dag = build_dag(out / "cus", out / "dag.json")
            write_bytes_atomically(out / "dag.json", (json.dumps(dag, indent=2) + "\n").encode())
            stage = "compile"
            compile_for_device(device, out / "cus", out / "dag.json", out)
            stage = "run"
            got = load(out / "dag.json", device).run({k: v for k, v in case.inputs.items() if k not in frozen})
        except CortexError as e:
            result.stage = stage
            # A clear refusal before running is a limitation; a compiled model that refuses to run is a bug.
            result.outcome = "unsupported" if stage != "run" else "crashed"
            result.why = _tidy(str(e), out)
            return
        except Exception as e:  # a bug in Cortex: recorded, the suite goes on
            result.stage, result.outcome = stage, "crashed"
            result.why = _tidy(f"{type(e).__name__}: {first_line(e)}", out)
            return
    result.stage = "compare"
    problem = compare_outputs(case.name, got, case.outputs)
    if problem is None:
        result.outcome = "passed"
    else:
        result.outcome, result.why = "failed", problem[0]
        result.max_abs_error, result.max_rel_error = problem[1], problem[2]


def compare_outputs(case_name: str, got: dict, expected: dict) -> tuple[str, float | None, float | None] | None:
    """None when every output matches (the onnx runner's checks: shape, dtype, allclose with NaNs
    equal); otherwise (why, max abs error, max rel error) of the first output that does not."""
    for name, want in expected.items():
        if name not in got:
            return f"output {name!r} missing", None, None
        actual, want = np.asarray(got[name]), np.asarray(want)
        if actual.shape != want.shape:
            return f"output {name!r} has shape {list(actual.shape)}, expected {list(want.shape)}", None, None
        if actual.dtype != want.dtype:
            return f"output {name!r} has dtype {actual.dtype}, expected {want.dtype}", None, None
        if want.dtype.kind in "OUSb":
            if not np.array_equal(actual, want):
                return f"output {name!r} differs in {int(np.sum(actual != want))} of {want.size} values", None, None
            continue
        rtol, atol = tolerances(case_name, want)
        a, w = actual.astype(np.float64), want.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            close = np.isclose(a, w, rtol=rtol, atol=atol, equal_nan=True)
            if close.all():
                continue
            diff = np.where(close, 0.0, np.abs(a - w))
            diff = np.where(np.isnan(diff), np.inf, diff)   # NaN where a number was expected, or back
            rel = diff / np.maximum(np.abs(w), np.finfo(np.float64).tiny)
        abs_err, rel_err = float(diff.max()), float(rel.max())
        return (f"output {name!r}: {int((~close).sum())} of {want.size} values off, max abs error "
                f"{abs_err:.3g}, max rel error {rel_err:.3g} (rtol {rtol:.3g}, atol {atol:.3g})", abs_err, rel_err)
    return None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def static_inputs(path: Path) -> set[str]:
    """Inputs whose declared shape has a fixed size in every dim."""
    model = onnx.load(path, load_external_data=False)
    return {vi.name for vi in model.graph.input if vi.type.HasField("tensor_type")
            and vi.type.tensor_type.HasField("shape")
            and all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)}


def _shape_text(value: np.ndarray) -> str:
    return "x".join(str(d) for d in value.shape) if value.ndim else "scalar"


def _tidy(message: str, tmp: Path) -> str:
    """One line without the temporary folder, so the table reads the same on every run."""
    return " ".join(message.replace(f"{tmp}/", "").replace(str(tmp), ".").split())[:400]
