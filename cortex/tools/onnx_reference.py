"""Run a dag.json with onnxruntime, one CU model after the other in the dag's topological order.

The reference device: it needs nothing but the CU models, so it checks a decomposition on its own
and is the yardstick the compiled backends are compared with. Branch CUs of a decomposed If run
as the scheduler runs them: only the taken branch's (`activation.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cortex.runtime.activation import Branches
from ir.fs import read_artifact
from ir.errors import CortexError


def run_dag(dag_path: Path, feeds: dict[str, np.ndarray], optimize: bool = False) -> dict[str, np.ndarray]:
    """The model's outputs by name. Graph optimisations are off by default so each kernel is
    onnxruntime's plain one, whichever way the model was cut."""
    dag_path = Path(dag_path)
    dag = json.loads(dag_path.read_text())
    cus = {cu["id"]: cu for cu in dag["cus"]}
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    env: dict[str, np.ndarray] = {}
    for spec in dag["inputs"]:
        if spec["name"] not in feeds:
            raise CortexError(f"no value given for the model input {spec['name']!r}")
        env[spec["name"]] = np.asarray(feeds[spec["name"]])
    branches = Branches(dag)
    for cu_id in dag["order"]:
        cu = cus[cu_id]
        if branches.skip_reason(cu, env.__getitem__) is not None:
            continue
        data = read_artifact(dag_path.parent / cu["path"], cu["sha256"], f"{cu_id} in {dag_path}", "rebuild the dag")
        session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        results = session.run(cu["outputs"], {name: env[name] for name in cu["inputs"]})
        env.update(zip(cu["outputs"], results))
        env.update((out, env[case]) for out, case in branches.selected(cu_id, env.__getitem__))
    return {spec["name"]: env[spec["name"]] for spec in dag["outputs"]}
