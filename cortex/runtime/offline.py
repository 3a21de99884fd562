"""The `offline` policy: no CUs, the source model that dag.json records (`source_model`, written by
build-dag) on onnxruntime. The emergency fallback when the compiled artifacts cannot be trusted or
loaded, so nothing here touches them.

The source model usually lives outside the folder of dag.json (decompose reads it from wherever
the user keeps it), so its path is relative to that folder and may climb out of it; what makes it
safe to run is its sha256, checked against the file's bytes before a session is built from those
same bytes. A missing or changed file is one line.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ir.errors import CortexError
from ir.fs import sha256_bytes

REBUILD = "run 'cortex build-dag' again next to the model it was decomposed from"


class SourceModel:
    def __init__(self, dag: dict, dag_path: Path):
        dag_path = Path(dag_path)
        record = dag.get("source_model")
        if record is None:
            raise CortexError(f"{dag_path}: records no source model, so the offline policy cannot run; {REBUILD}")
        frozen = [f["name"] for f in dag.get("options", {}).get("frozen_inputs", [])]
        if frozen:
            raise CortexError(f"{dag_path}: the CUs were built with --freeze-input {', '.join(frozen)}; the source "
                              "model still takes those inputs, whose values dag.json does not hold, so the offline "
                              "policy cannot run it")
        self.path = dag_path.parent / record["path"]
        self.relative_path = record["path"]
        self.sha256 = record["sha256"]
        self.output_names = [spec["name"] for spec in dag["outputs"]]
        try:
            data = self.path.read_bytes()
        except OSError:
            raise CortexError(f"{self.path}: the source model dag.json records is missing; {REBUILD}") from None
        if sha256_bytes(data) != self.sha256:
            raise CortexError(f"{self.path}: the source model changed since build-dag (its sha256 differs from "
                              f"{dag_path}'s); {REBUILD}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        except Exception as e:   # onnxruntime raises its own exception types
            raise CortexError(f"{self.path}: onnxruntime cannot load the source model: {_first_line(e)}") from None
        produced = {o.name for o in self.session.get_outputs()}
        missing = [name for name in self.output_names if name not in produced]
        if missing:
            raise CortexError(f"{self.path}: the source model has no output {missing[0]!r}, which dag.json names")
        self.input_names = [i.name for i in self.session.get_inputs()]

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> tuple[dict[str, np.ndarray], dict]:
        """The requested outputs, and what the trace says of the run."""
        missing = [name for name in self.input_names if name not in feeds]
        if missing:
            raise CortexError(f"{self.path}: the source model needs input {missing[0]!r}, which dag.json does not list")
        cpu_start, start = time.thread_time(), time.perf_counter()
        try:
            results = self.session.run(outputs, {name: feeds[name] for name in self.input_names})
        except Exception as e:
            raise CortexError(f"{self.path}: onnxruntime failed on the source model: {_first_line(e)}") from None
        seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu_start
        return dict(zip(outputs, results)), {"model": self.relative_path, "sha256": self.sha256,
                                             "runtime": "onnxruntime", "start": start, "seconds": seconds,
                                             "cpu_seconds": cpu_seconds}


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
