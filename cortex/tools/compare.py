"""How `cortex verify` compares a tensor with its reference: elementwise within `atol + rtol * |ref|`,
NaN where the reference has NaN, and an infinity where the reference has the same one, counting as
equal. Shared by the whole-model check and the
per-CU bisection, so both judge with the same rule. Each row also carries the accuracy metrics
(`cortex.tools.accuracy`): cosine similarity, top-1 agreement and the relative L2 error."""

from __future__ import annotations

import numpy as np

from cortex.tools.accuracy import cosine_similarity, relative_l2_error, top1_agreement


def compare(name: str, ours: np.ndarray, reference: np.ndarray, rtol: float, atol: float) -> dict:
    """One report row: the largest absolute and relative error, and whether every element is
    within tolerance. `tolerance_ratio` is the largest error in units of the allowed one (above
    1: outside), so that errors of outputs of different scales can be ranked."""
    if ours.shape != reference.shape or ours.dtype != reference.dtype:
        return {"name": name, "shape": list(ours.shape), "dtype": str(ours.dtype), "ok": False,
                "max_abs_error": float("inf"), "max_rel_error": float("inf"), "tolerance_ratio": float("inf"),
                "cosine": None, "top1": None, "relative_l2_error": None,
                "why": f"got {ours.dtype}{list(ours.shape)}, expected {reference.dtype}{list(reference.shape)}"}
    metrics = {"dtype": str(ours.dtype), "cosine": cosine_similarity(ours, reference),
               "top1": top1_agreement(ours, reference), "relative_l2_error": relative_l2_error(ours, reference)}
    a, b = ours.astype(np.float64), reference.astype(np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    with np.errstate(invalid="ignore"):      # inf - inf: equal infinities are no error
        diff = np.where(both_nan | (a == b), 0.0, np.abs(a - b))
    allowed = atol + rtol * np.abs(b)
    if not diff.size:
        return {"name": name, "shape": list(ours.shape), "ok": True, "max_abs_error": 0.0, "max_rel_error": 0.0,
                "tolerance_ratio": 0.0, **metrics}
    abs_err = float(np.max(diff))
    rel_err = float(np.max(diff / np.maximum(np.abs(b), np.finfo(np.float32).tiny)))
    ok = bool(np.all(both_nan | (diff <= allowed)))
    # A NaN error (one side NaN) is outside any tolerance; with a zero tolerance any error is infinite.
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, np.where(np.isnan(diff), np.inf, diff / allowed))
    return {"name": name, "shape": list(ours.shape), "ok": ok, "max_abs_error": abs_err, "max_rel_error": rel_err,
            "tolerance_ratio": float(np.max(ratio)), **metrics}
