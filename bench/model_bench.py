"""The model benchmark: each model under onnxruntime (native CPU, one thread), onnxruntime-web (WASM
in Node, one thread) and Cortex (WASM under wasmtime, one thread), timed interleaved."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

ort.set_default_logger_severity(3)  # unused-initializer warnings of the zoo models are noise here

from bench import cortex_side
from bench.node_runner import NodeContestant, NodeRunner
from bench.timing import InProcess, Timings, interleave, repeats_for
from samples.detector import detector
from samples.light_models import LIGHT_MODEL_NAMES, light_model
from samples.minilm import minilm_feed
from samples.qdq_models import qdq_minilm, qdq_squeezenet
from samples.quantized_models import quantized_light_model, quantized_minilm
from samples.recurrent import SPECS as RECURRENT_SPECS
from samples.recurrent import recurrent

MINILM = "minilm-l6-s128"
MODEL_NAMES = (*LIGHT_MODEL_NAMES, MINILM)
# A YOLOv8n-style detector exported from torch (samples/detector.py): the threads and op-class sections.
DETECTOR = "detector-yolov8n"
# The second table: recurrent layers at realistic sizes (torch exports) and quantized models, each
# compared on the same file.
RECURRENT_NAMES = tuple(f"recurrent-{name}" for name in RECURRENT_SPECS)
# onnxruntime's quantizer in its three formats: quantize_dynamic (then onnxruntime's own fusions
# into DynamicQuantizeMatMul / MatMulIntegerToFloat), quantize_static QOperator, quantize_static QDQ.
QUANTIZED_NAMES = (f"{MINILM}-int8-dynamic", f"{MINILM}-int8-qoperator", f"{MINILM}-int8-qdq",
                   f"{MINILM}-int8-qdq-per-channel", "squeezenet-int8-dynamic", "squeezenet-int8-qoperator",
                   "squeezenet-int8-qdq", "shufflenet-int8-dynamic", "shufflenet-int8-qoperator")
EXTRA_NAMES = (*RECURRENT_NAMES, *QUANTIZED_NAMES)
ALL_NAMES = (*MODEL_NAMES, *EXTRA_NAMES)


@dataclass
class ModelCase:
    name: str
    path: Path
    feeds: dict[str, np.ndarray]
    input_shapes: dict[str, tuple[int, ...]]
    dims: dict[str, int] = field(default_factory=dict)
    # How far Cortex's output may be from onnxruntime's, as a fraction of the output's largest
    # magnitude; None: the float tolerance. A quantized model rounds to the nearest step where a
    # last-bit difference in the float op before a DynamicQuantizeLinear or QuantizeLinear flips
    # the choice, and the flips carry through the layers: the check is against a wrong kernel.
    quantized_tolerance: float | None = None


QUANTIZED_TOLERANCE = 0.15


def _quantum(values: np.ndarray) -> float:
    """The smallest step between distinct values of an output (0 for a constant one)."""
    distinct = np.unique(values)
    return float(np.min(np.diff(distinct))) if distinct.size > 1 else 0.0


def model_case(name: str) -> ModelCase:
    if name in RECURRENT_NAMES:
        m = recurrent(name.removeprefix("recurrent-"))
        return ModelCase(name, m.path, m.inputs, m.input_shapes, m.dims)
    if name in QUANTIZED_NAMES:
        return _quantized_case(name)
    if name == DETECTOR:
        m = detector()
        return ModelCase(name, m.path, m.inputs, m.input_shapes)
    if name == MINILM:
        from samples.minilm import minilm
        m = minilm(batch=1, seq=128)  # exports the model into .cache/models on first use
        return ModelCase(name, m.path, m.inputs, m.input_shapes, m.dims)
    m = light_model(name)
    return ModelCase(name, m.path, m.inputs, m.input_shapes)


def _quantized_case(name: str) -> ModelCase:
    model, _, form = name.partition("-int8-")
    if model == MINILM:
        if form.startswith("qdq"):
            m = qdq_minilm(per_channel=form.endswith("per-channel"), batch=1, seq=128)
            return ModelCase(name, m.path, m.inputs, {}, m.dims, QUANTIZED_TOLERANCE)
        q = quantized_minilm(static=form == "qoperator")
        return ModelCase(name, q.path, minilm_feed(1, 128), {}, {"batch": 1, "seq": 128}, QUANTIZED_TOLERANCE)
    if form == "qdq":
        m = qdq_squeezenet()
        return ModelCase(name, m.path, m.inputs, m.input_shapes, m.dims, QUANTIZED_TOLERANCE)
    q = quantized_light_model(model, static=form == "qoperator")
    return ModelCase(name, q.path, q.feed, q.input_shapes, q.dims, QUANTIZED_TOLERANCE)


@dataclass
class ModelResult:
    name: str
    timings: dict[str, Timings] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)      # contestant -> why it has no number
    memory: dict | None = None
    compile_s: float | None = None
    load_s: float | None = None

    def median_ms(self, contestant: str) -> float | None:
        t = self.timings.get(contestant)
        return t.median * 1e3 if t and t.seconds else None

    def to_json(self) -> dict:
        return {"model": self.name, "timings": {k: t.to_json() for k, t in self.timings.items()},
                "errors": self.errors, "memory": self.memory, "compile_s": self.compile_s, "load_s": self.load_s}


def _ort_session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _node_dtype(array: np.ndarray) -> str:
    return {"float32": "float32", "int64": "int64", "int32": "int32", "bool": "bool", "uint8": "uint8"}[array.dtype.name]


def bench_model(name: str, node: NodeRunner | None, rounds: int, log=print) -> ModelResult:
    result = ModelResult(name)
    case = model_case(name)
    try:
        result.memory = cortex_side.memory_plan(case.path, case.input_shapes, case.dims)
    except Exception as e:  # noqa: BLE001  (the report says why instead of stopping the run)
        result.errors["memory"] = f"{type(e).__name__}: {e}"
    session = _ort_session(case.path)
    reference = dict(zip([o.name for o in session.get_outputs()], session.run(None, case.feeds)))
    contestants = []
    start = time.perf_counter()
    session.run(None, case.feeds)
    once = time.perf_counter() - start
    contestants.append(InProcess("ort-cpu", lambda: session.run(None, case.feeds)))
    with tempfile.TemporaryDirectory(prefix=f"cortex-bench-{name}-") as tmp:
        workdir = Path(tmp)
        if node is not None:
            inputs = []
            for input_name, array in case.feeds.items():
                path = workdir / f"input-{len(inputs)}.bin"
                path.write_bytes(np.ascontiguousarray(array).tobytes())
                inputs.append({"name": input_name, "dtype": _node_dtype(array), "shape": list(array.shape),
                               "data": str(path)})
            try:
                node.ask(cmd="load", id=name, model=str(case.path), inputs=inputs)
                contestants.append(NodeContestant("ort-web", node, name))
            except RuntimeError as e:
                result.errors["ort-web"] = str(e)[:200]
        else:
            result.errors["ort-web"] = "Node or onnxruntime-web not available"
        try:
            tolerance = {}
            if case.quantized_tolerance is not None:
                largest = max(float(np.max(np.abs(v))) for v in reference.values())
                # An output that a DequantizeLinear writes moves by whole quanta: one flipped rounding is
                # a quantum, which may pass 15% of a small output (squeezenet's softmax, 1/256).
                quantum = max(_quantum(v) for v in reference.values())
                tolerance = {"rtol": 0.0, "atol": max(case.quantized_tolerance * largest, 1.01 * quantum)}
            built = cortex_side.build(case.path, case.input_shapes, case.dims, case.feeds, reference,
                                      workdir / "cortex", **tolerance)
            contestants.append(built.contestant)
            result.compile_s, result.load_s = built.compile_s, built.load_s
        except cortex_side.NotAvailable as e:
            result.errors["cortex-wasm"] = str(e)
        except Exception as e:  # noqa: BLE001  (a crash in a stage is reported, not fatal to the run)
            result.errors["cortex-wasm"] = f"{type(e).__name__}: {str(e)[:160]}"
        result.timings = interleave(contestants, rounds, repeats_for(once * 2, budget=0.5, most=10), warmup=1)
    log(f"  {name}: " + ", ".join(f"{k} {t.median * 1e3:.1f} ms" for k, t in result.timings.items())
        + "".join(f"; {k}: {e}" for k, e in result.errors.items()))
    return result
