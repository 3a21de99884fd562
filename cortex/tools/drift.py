"""Why a compiled model's outputs differ from onnxruntime's: dynamic quantization or a wrong CU
(`cortex verify` says so when the outputs are outside the tolerance).

A dynamically quantized model computes each activation's scale and codes at run time
(DynamicQuantizeLinear, also inside DynamicQuantizeMatMul and DynamicQuantizeLSTM once expanded,
and MatMulNBits at accuracy level 4: the op registry's `quantizes_activations`):
a last-bit difference in a float op before it (an Erf, a Softmax, a LayerNorm summed in another
order) moves a scale or flips a code by one step, and every later layer carries that step. Such a
model is right when each CU computes what its cu.onnx says on its own inputs, up to that one step,
and the outputs start to drift at a CU that quantizes, or reads what one quantized. Anything else
is a CU that computes something else (a bug to report), or float errors adding up.

The facts come from `cortex.tools.bisect`: each CU judged on its own inputs, and the first CU
whose outputs leave onnxruntime's CU-by-CU run (where the drift starts).
"""

from __future__ import annotations

from dataclasses import dataclass

from cortex.tools.bisect import BisectReport, CUCheck

# A code flipped by one step moves one element of a tensor by one of 255 steps of its range: an
# output of a quantizing CU whose relative L2 error stays below that is off by such steps only.
ONE_STEP_RELATIVE_L2 = 1.0 / 255


@dataclass(frozen=True)
class DriftCause:
    quantization: bool              # dynamic quantization explains the difference
    drift_start_cu: str | None      # the first CU whose outputs leave onnxruntime's CU-by-CU run
    wrong_cu: str | None            # the first CU wrong on its own inputs by more than one quantization step
    lines: tuple[str, ...]          # the explanation, in one or two plain lines

    def to_json(self) -> dict:
        return {"quantization": self.quantization, "drift_start_cu": self.drift_start_cu,
                "wrong_cu": self.wrong_cu, "lines": list(self.lines)}


def quantizes(check: CUCheck) -> bool:
    """The CU quantizes activations at run time (the op registry's `quantizes_activations`, recorded
    in dag.json)."""
    return check.quantizes


def within_one_step(check: CUCheck) -> bool:
    """The CU's outputs on its own inputs are within the tolerance, or, for a CU that quantizes,
    within one quantization step: codes off by one at most, float results by a few steps."""
    if check.ok or not check.compared:
        return True
    if not quantizes(check):
        return False
    for row in check.outputs:
        if row["ok"]:
            continue
        if row.get("why") or row.get("relative_l2_error") is None:
            return False
        integer = row["dtype"].startswith(("int", "uint"))
        if integer and row["max_abs_error"] > 1:
            return False
        if not integer and not row["relative_l2_error"] <= ONE_STEP_RELATIVE_L2:
            return False
    return True


def explain(report: BisectReport, dag: dict) -> DriftCause:
    """The cause of a difference beyond the tolerance, from the bisection of the same run."""
    judged = [c for c in report.checks if c.compared and not c.fallback]
    wrong = next((c for c in judged if not within_one_step(c)), None)
    start = report.first_drifting
    if wrong is not None:
        where = "" if start is None or start.cu == wrong.cu else f"; the outputs first drift at {_name(start)}"
        return DriftCause(False, start.cu if start else None, wrong.cu, (
            f"not quantization: {_name(wrong)} differs from onnxruntime on its own inputs beyond the tolerance "
            f"(max abs error {_largest(wrong):.3g}){where}",
            "look at that CU with --bisect --dump DIR; far outside the tolerance, it is a bug to report"))
    if start is None:
        if any(quantizes(c) for c in report.checks):
            return DriftCause(True, None, None, (
                "quantization explains the difference: every CU agrees with onnxruntime run CU by CU, and "
                "onnxruntime's run of the source model quantizes its activations at run time from "
                "float results computed in another order",
                "a verdict by --metric (cosine, top-1) fits such a model better than an elementwise tolerance"))
        return DriftCause(False, None, None, (
            "every CU agrees with onnxruntime run CU by CU: the difference is between the source model and "
            "its optimised graph, both on onnxruntime",))
    producers = {out: cu["id"] for cu in dag.get("cus", []) for out in cu["outputs"]}
    by_id = {c.cu: c for c in report.checks}
    read = _inputs_of(dag, start.cu)
    after = next((by_id[producers[t]] for t in read if t in producers and producers[t] in by_id
                  and quantizes(by_id[producers[t]])), None)
    if quantizes(start) or after is not None:
        where = "quantizes activations at run time" if quantizes(start) else f"reads what {after.cu} quantized"
        return DriftCause(True, start.cu, None, (
            f"quantization explains the difference: every CU agrees with onnxruntime on its own inputs (within "
            f"one quantization step), and the outputs start to drift at {_name(start)}, which {where}: a "
            "last-bit difference before it moves a scale or flips a code, and the later layers carry it",
            "a verdict by --metric (cosine, top-1) fits such a model better than an elementwise tolerance"))
    return DriftCause(False, start.cu, None, (
        f"no CU is wrong on its own inputs; the outputs start to drift at {_name(start)}, with no dynamic "
        "quantization there: small float errors add up (see --bisect for each CU's own error)",))


def _name(check: CUCheck) -> str:
    return f"{check.cu} ({', '.join(check.op_types)})"


def _largest(check: CUCheck) -> float:
    return max((row["max_abs_error"] for row in check.outputs if not row["ok"]), default=0.0)


def _inputs_of(dag: dict, cu_id: str) -> list[str]:
    return next((cu["inputs"] for cu in dag.get("cus", []) if cu["id"] == cu_id), [])
