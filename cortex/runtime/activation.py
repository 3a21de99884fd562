"""Conditional CUs: the branch CUs of a decomposed If and the selects that stand for its outputs.

dag.json's `cus[i].activation` (`{"tensor": COND, "equals": VALUE}`) says a CU belongs to one
branch: it runs only when the scalar COND has VALUE, and is otherwise skipped with the reason
`inactive branch`, so its outputs never exist in that request. `selects` name the If's outputs,
which no CU produces: once the CU writing the case the condition picks has run, the select's
tensor is that case's tensor (the same array, on the same device), and the CUs after it read it
by the select's name. dag_checks guarantees the condition is available before any of them.

The scheduler asks `skip_reason` before running a CU and `selected` after; the reference runner
(`onnx_reference.py`) does the same, so both agree on what a branch CU means.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

INACTIVE = "inactive branch"


def condition_value(value) -> bool:
    return bool(np.asarray(value).reshape(-1)[0])


class Branches:
    def __init__(self, dag: dict):
        producer = {name: cu["id"] for cu in dag["cus"] for name in cu["outputs"]}
        # CU -> (select tensor, condition, value, case tensor) for each case that CU writes.
        self.cases_of: dict[str, list[tuple[str, str, bool, str]]] = {}
        for s in dag.get("selects", []):
            for case in s["cases"]:
                self.cases_of.setdefault(producer[case["tensor"]], []).append(
                    (s["tensor"], s["condition"], case["equals"], case["tensor"]))

    def skip_reason(self, cu: dict, value_of: Callable[[str], object]) -> str | None:
        """Why `cu` must not run, given `value_of(tensor)` (a host array), or None."""
        activation = cu.get("activation")
        if activation is None or condition_value(value_of(activation["tensor"])) == activation["equals"]:
            return None
        return INACTIVE

    def selected(self, cu_id: str, value_of: Callable[[str], object]) -> list[tuple[str, str]]:
        """(select tensor, case tensor) pairs that the CU `cu_id`, which just ran, resolves: the
        cases it wrote that the condition picks (when every CU runs, the other branch's cases
        are written too, and left unselected)."""
        return [(out, case) for out, cond, equals, case in self.cases_of.get(cu_id, ())
                if condition_value(value_of(cond)) == equals]
