"""A self-contained reproduction of one CU's result (`cortex verify --bisect --dump DIR`).

The folder holds the CU as a model of its own: its cu.onnx, a dag.json with that one CU, its
compiled artifacts at the paths that dag.json names, the inputs the CU received in the compiled
run (inputs.npz), onnxruntime's outputs on them (expected.npz), the device's (actual.npz), and
the command that checks it again (repro.sh, also in README.md):

    cortex verify dag.json --model cu.onnx --input inputs.npz --device D --rtol R --atol A

The one-CU dag.json records cu.onnx's sha256 as its model's, so verify accepts cu.onnx as the
source model; it is checked with `read_dag` before the folder is swapped in.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import zipfile
from pathlib import Path

import numpy as np
import onnx

from cortex.dag import read_dag
from cortex.tools.bisect import CUCase, CUCheck, describe
from ir.errors import CortexError
from ir.fs import confined_path, current_umask, read_artifact, write_bytes_atomically, write_directory_atomically

# The keys of a CU record that describe the computation itself; activation, caching and variants
# belong to its place in the whole model, and the reproduction runs the CU unconditionally.
CU_KEYS = ("id", "path", "sha256", "params", "depth", "flops", "op_types", "inputs", "outputs", "runs_on")


def write_reproduction(folder: Path, dag: dict, dag_path: Path, case: CUCase, check: CUCheck, device: str,
                       rtol: float, atol: float) -> list[str]:
    """Write the reproduction folder atomically; returns the command that reproduces it, as argv
    to run inside the folder."""
    command = ["cortex", "verify", "dag.json", "--model", "cu.onnx", "--input", "inputs.npz", "--device", device,
               "--rtol", repr(rtol), "--atol", repr(atol)]

    def fill(tmp: Path) -> None:
        cu = case.cu
        source = Path(dag_path).parent
        model = read_artifact(source / cu["path"], cu["sha256"],     # read_dag kept the path inside
                              f"{cu['id']} in {dag_path}", "run 'cortex decompose' and 'cortex build-dag' again")
        write_bytes_atomically(tmp / "cu.onnx", model)
        for location in external_data_files(model):     # a specialized CU's weights, beside it as in its folder
            path = confined_path((source / cu["path"]).parent, location)
            if path is None or not path.is_file():
                raise CortexError(f"{dag_path}: {cu['id']}'s cu.onnx names external data {location!r}, "
                                  "which is missing")
            write_bytes_atomically(tmp / location, path.read_bytes())
        artifacts = {}
        for kind, record in cu.get("artifacts", {}).items():
            files = artifact_files(kind, record)
            if files is None:
                continue            # a kind of artifact this dump does not know the files of
            for relative in files:
                path = confined_path(source, relative)
                if path is None or not path.is_file():
                    raise CortexError(f"{dag_path}: {cu['id']}'s {kind} artifact file {relative!r} is missing")
                write_bytes_atomically(tmp / relative, path.read_bytes())
            artifacts[kind] = record
        one_cu = one_cu_dag(dag, cu, artifacts)
        write_bytes_atomically(tmp / "dag.json", (json.dumps(one_cu, indent=2) + "\n").encode())
        for name, arrays in (("inputs", case.inputs), ("expected", case.expected), ("actual", case.actual)):
            write_bytes_atomically(tmp / f"{name}.npz", npz_bytes(arrays))
        line = shlex.join(command)
        write_bytes_atomically(tmp / "repro.sh", f'#!/bin/sh\ncd "$(dirname "$0")" && exec {line}\n'.encode())
        os.chmod(tmp / "repro.sh", 0o777 & ~current_umask())
        write_bytes_atomically(tmp / "README.md", readme(dag, cu, check, line, rtol, atol).encode())
        read_dag(tmp / "dag.json")      # what was written must load, or nothing is swapped in

    write_directory_atomically(Path(folder), fill)
    return command


def one_cu_dag(dag: dict, cu: dict, artifacts: dict) -> dict:
    """The dag.json of a model that is this one CU: its inputs are the model's inputs, its outputs
    the model's outputs, and cu.onnx (next to it) is both the CU and the source model."""
    cu_id = cu["id"]
    record = {**{k: cu[k] for k in CU_KEYS if k in cu}, "path": "cu.onnx", "artifacts": artifacts}

    def io(name: str) -> dict:
        return {"name": name, "dtype": dag["tensors"][name]["dtype"], "shape": dag["tensors"][name]["shape"]}

    tensors = {name: {**dag["tensors"][name], "producer": cu_id if name in cu["outputs"] else None,
                      "consumers": [cu_id] if name in cu["inputs"] else []}
               for name in [*cu["inputs"], *cu["outputs"]]}
    # The frozen inputs belong to the source model; verify would ask for them again.
    options = {k: v for k, v in dag.get("options", {}).items() if k != "frozen_inputs"}
    return {"schema": dag["schema"],
            "model": {"name": f"{dag['model'].get('name') or 'model'} {cu_id}", "sha256": cu["sha256"],
                      "opsets": dag["model"].get("opsets", {})},
            "options": options,
            "inputs": [io(n) for n in cu["inputs"]],
            "outputs": [io(n) for n in cu["outputs"]],
            "tensors": dict(sorted(tensors.items())),
            "cus": [record], "edges": [], "order": [cu_id], "levels": [[cu_id]],
            "critical_path": {"cus": [cu_id], "flops": cu.get("flops", 0)}}


def external_data_files(model: bytes) -> list[str]:
    """The files (relative to the model's folder) holding a model's external tensors."""
    graphs, found = [onnx.load_from_string(model).graph], set()
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                found.update(e.value for e in tensor.external_data if e.key == "location")
        graphs += [g for node in graph.node for a in node.attribute for g in [*([a.g] if a.HasField("g") else []),
                                                                            *a.graphs]]
    return sorted(found)


def artifact_files(kind: str, record: dict) -> list[str] | None:
    """The files (relative to dag.json) an artifact record names; None for a kind not known here."""
    if kind == "wasm":     # the module, and its weight files when they are outside it
        return [record["path"], *(w["path"] for w in record.get("weights", ()))]
    if kind == "cuda":
        weights = record["weights"]    # one blob, or content-addressed segments (--external-weights)
        entries = [record["source"], record["ptx"], *record["cubins"].values(), *weights.get("segments", [weights])]
        return [f"{record['folder']}/{e['file']}" for e in entries if e]
    return None


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz of the arrays by name, written entry by entry: `np.savez(f, **arrays)` fails on a
    tensor named `file`, and stamps the current time into each entry (this is reproducible)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w",
                              force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def readme(dag: dict, cu: dict, check: CUCheck, command: str, rtol: float, atol: float) -> str:
    verdict = "diverges from" if not check.ok else "agrees (within tolerance) with"
    return (f"# {cu['id']} of {dag['model'].get('name') or 'the model'}\n\n"
            f"On its own inputs, {cu['id']} ({', '.join(check.op_types)}) on {check.device} {verdict} onnxruntime "
            f"(rtol {rtol:g}, atol {atol:g}):\n{describe(check)}\n\n"
            "Files: cu.onnx (the CU as an ONNX model), dag.json (a model of this one CU) and its compiled artifact, "
            "inputs.npz (what the CU received in the compiled run), expected.npz (onnxruntime on them), "
            "actual.npz (the device).\n\n"
            f"Reproduce, in this folder, with the `cortex` command on PATH (or run `sh repro.sh`):\n\n    {command}\n")
