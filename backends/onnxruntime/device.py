"""The onnxruntime device: one InferenceSession per CU, on its cu.onnx (the path and sha256 that
dag.json records for the CU), CPU provider, one intra-op thread unless told otherwise.

`load` reads each file once, checks its sha256 against dag.json (a tampered or stale file is
refused in one line) and builds the session from those same bytes. Tensors are numpy arrays of
this process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from backends.registry import HostTensors
from ir.errors import CortexError
from ir.fs import confined_path, read_artifact


class OnnxruntimeDevice(HostTensors):
    name = "onnxruntime"
    concurrent_runs = True   # InferenceSession.run may be called from several threads at once

    def __init__(self, dag: dict, dag_path: Path, *, threads: int = 1):
        self.dag_path = Path(dag_path)
        self.threads = threads
        self.sessions: dict[str, ort.InferenceSession] = {}
        self.sizes: dict[str, int] = {}

    def load(self, cus: list[dict]) -> None:
        for cu in cus:
            if cu["id"] in self.sessions:
                continue
            path = confined_path(self.dag_path.parent, cu["path"])
            if path is None:
                raise CortexError(f"{self.dag_path}: {cu['id']}'s path {cu['path']!r} leaves the folder of dag.json")
            data = read_artifact(path, cu["sha256"], f"{cu['id']} in {self.dag_path}",
                                 "run 'cortex decompose' and 'cortex build-dag' again")
            try:
                self.sessions[cu["id"]] = ort.InferenceSession(data, self._options(path.parent),
                                                               providers=["CPUExecutionProvider"])
            except Exception as e:   # onnxruntime raises its own exception types
                raise CortexError(f"{path}: onnxruntime cannot load {cu['id']}: {_first_line(e)}") from None
            self.sizes[cu["id"]] = len(data)

    def _options(self, folder: Path) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # A session built from bytes finds external weights (a specialized CU folder's cu.onnx
        # keeps them in shared files) only through this folder, not next to the file.
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
        return options

    def run(self, cu: dict, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            results = self.sessions[cu["id"]].run(cu["outputs"], inputs)
        except Exception as e:
            raise CortexError(f"{cu['id']} ({', '.join(cu.get('op_types', []))}) failed on onnxruntime: "
                              f"{_first_line(e)}") from None
        return dict(zip(cu["outputs"], results))

    def resident_bytes(self, cu_id: str) -> int:
        """The model bytes the session was built from (weights included); onnxruntime's own
        arena is not counted."""
        return self.sizes.get(cu_id, 0)

    def footprint(self, cu: dict) -> int:
        path = confined_path(self.dag_path.parent, cu["path"])
        try:
            return path.stat().st_size if path is not None else 0
        except OSError:
            return 0     # `load` reports the missing file

    def unload(self, cu_id: str) -> int:
        self.sessions.pop(cu_id, None)
        return self.sizes.pop(cu_id, 0)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
