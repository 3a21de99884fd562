"""Write a partition as files: one self-contained ONNX model per CU plus `manifest.json`.

Each CU model holds only the weights its nodes read; its graph inputs and outputs are the tensors
that cross its border (named as in the source model), so running the CUs one after the other and
passing tensors by name reproduces the whole model. The manifest (`cortex.cus/1`) is the contract
the backends and `build-dag` read.

A large If decomposed into branch CUs (`passes/branch_cus.py`) leaves its outputs to no CU: each
branch CU records its `activation` (the condition and the branch's value) and the manifest's
`selects` say which branch tensor each If output is, per value of the condition.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
from onnx import TensorProto

from ir import dtypes
from ir.errors import CortexError, UnsupportedError
from ir.fs import file_sha256, sha256_bytes, write_directory_atomically
from ir.graph import Graph, Node, Value, outer_reads
from ir.onnx_export import export_model
from ir.ops.registry import node_flops, quantizes_activations
from passes.expand_ops import declined_because
from passes.partition import Partition

MANIFEST_SCHEMA = "cortex.cus/1"
MANIFEST = "manifest.json"

# A CU folder of shape specializations lists its per-shape CU folders here (cortex/specializations.py).
SPECIALIZATIONS_LISTING = "specializations.json"

def cu_id(index: int) -> str:
    return f"cu-{index:04d}"


def dtype_name(dtype: int) -> str:
    """numpy's spelling (float32, int64, bool...), which the manifest and dag.json use."""
    return np.dtype(dtypes.to_numpy(dtype)).name


def tensor_info(v: Value) -> dict:
    if v.is_tensor and v.dtype == TensorProto.STRING:
        why = declined_because(v.producer) if v.producer is not None else None
        made = f" (node {v.producer.name!r} makes it{': ' + why if why else ''})" if v.producer is not None else ""
        raise UnsupportedError(f"{v.name!r} is a string tensor{made}; CUs exchange only numeric tensors, so it "
                               "cannot be a model input or output or cross a CU border")
    if not v.is_tensor or v.dtype == dtypes.UNDEFINED or not v.is_static:
        kind = "a non-tensor value (sequence, optional or map)" if not v.is_tensor else "a tensor of unknown type or shape"
        hint = ""
        if v.producer is not None and v.producer.op_type == "ZipMap":
            # skl2onnx ends a classifier with ZipMap (maps of probabilities) unless told not to.
            hint = (f" (node {v.producer.name!r} (ZipMap) makes it: convert the model with skl2onnx's "
                    "options={id(model): {'zipmap': False}} to get the probabilities as a tensor)")
        raise UnsupportedError(f"{v.name!r} is {kind}; CUs exchange only tensors of static shape and known "
                               f"dtype, so it cannot be a model input or output or cross a CU border{hint}")
    info = {"dtype": dtype_name(v.dtype), "shape": list(v.shape), "bytes": v.nbytes}
    if v.is_bounded:   # shape and bytes are the upper bound; the real length comes at run time
        info["bound_axis"] = v.bound_axis
    return info


def cu_graph(graph: Graph, nodes: list[Node], name: str, outside_readers: set[int]) -> Graph:
    """The CU as a graph of its own: inputs are the non-constant values it reads but does not
    produce; outputs are the values it produces that another CU or the model's output reads."""
    produced = {id(out) for n in nodes for out in n.outputs}
    inputs: dict[int, Value] = {}
    for node in nodes:
        for v in [*node.present_inputs, *outer_reads(node)]:
            if not v.is_const and id(v) not in produced:
                inputs.setdefault(id(v), v)
    outputs = [out for n in nodes for out in n.outputs if id(out) in outside_readers]
    return Graph(name=name, nodes=list(nodes), inputs=list(inputs.values()), outputs=outputs,
                 opset_imports=dict(graph.opset_imports), ir_version=graph.ir_version,
                 producer_name="cortex", functions=list(graph.functions))


def outside_readers(graph: Graph, partition: Partition) -> set[int]:
    """Values read outside the CU that produces them (by another CU, as a model output, or by a
    Select of a hoisted If, which no CU holds: its condition and cases)."""
    cu_of = partition.cu_of()
    read: set[int] = {id(v) for v in graph.outputs}
    for node in graph.nodes:
        for v in [*node.present_inputs, *outer_reads(node)]:
            producer = v.producer
            if producer is not None and cu_of.get(id(producer)) != cu_of.get(id(node)):
                read.add(id(v))
    return read


def write_cus(graph: Graph, partition: Partition, out_dir: Path, source: dict, options: dict,
              on_cu: Callable[[int], None] | None = None) -> dict:
    """Build the CU folder next to `out_dir` and swap it in; returns the manifest."""
    crossing = outside_readers(graph, partition)

    def fill(folder: Path) -> dict:
        tensors: dict[str, dict] = {v.name: tensor_info(v) for v in [*graph.inputs, *graph.outputs]}
        entries = []
        for i, cu in enumerate(partition.cus):
            name = cu_id(i)
            sub = cu_graph(graph, cu.nodes, name, crossing)
            if not sub.outputs:
                raise AssertionError(f"{name} produces nothing another CU or the model reads")
            data = export_model(sub).SerializeToString()
            path = folder / name / "cu.onnx"
            path.parent.mkdir()
            path.write_bytes(data)
            for v in [*sub.inputs, *sub.outputs]:
                tensors[v.name] = tensor_info(v)
            groups: dict[str, list[str]] = {}
            for n in cu.nodes:
                if n.fusion_group is not None:
                    groups.setdefault(n.fusion_group, []).append(n.name)
            entries.append({
                "id": name, "path": f"{name}/cu.onnx", "sha256": sha256_bytes(data),
                "nodes": [n.name for n in cu.nodes],
                "op_types": sorted({n.op_type for n in cu.nodes}),
                **({"quantizes": True} if any(quantizes_activations(n) for n in cu.nodes) else {}),
                "fusion_groups": [g for g in groups.values() if len(g) > 1],
                "params": cu.params, "depth": cu.depth,
                "flops": sum(node_flops(n) for n in cu.nodes),
                "inputs": [v.name for v in sub.inputs], "outputs": [v.name for v in sub.outputs],
            })
            if cu.runs_on is not None:
                entries[-1]["runs_on"] = cu.runs_on   # its cu.onnx is its artifact: no target builds it
            if cu.over_limit is not None:
                entries[-1]["over_limit"] = cu.over_limit
            if cu.activation is not None:
                entries[-1]["activation"] = {"tensor": cu.activation[0], "equals": cu.activation[1]}
            if cu.cache is not None:
                entries[-1]["cache"] = cu.cache
            if on_cu:
                on_cu(i)
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "model": source,
            "options": options,
            "inputs": [{"name": v.name, **_io(v)} for v in graph.inputs],
            "outputs": [{"name": v.name, **_io(v)} for v in graph.outputs],
            "tensors": dict(sorted(tensors.items())),
            "cus": entries,
        }
        if partition.selects:
            for s in partition.selects:
                for v in (s.output, s.condition, *(case for _, case in s.cases)):
                    tensors[v.name] = tensor_info(v)
            manifest["tensors"] = dict(sorted(tensors.items()))
            manifest["selects"] = [{"tensor": s.output.name, "condition": s.condition.name,
                                    "cases": [{"equals": value, "tensor": case.name} for value, case in s.cases]}
                                   for s in partition.selects]
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest

    return write_directory_atomically(out_dir, fill)


def _io(v: Value) -> dict:
    info = tensor_info(v)  # the same checks
    return {"dtype": info["dtype"], "shape": info["shape"], **({"bound_axis": v.bound_axis} if v.is_bounded else {})}


def check_output_dir(out_dir: Path, model_path: Path) -> None:
    """The output folder is replaced as a whole, so it must be new, empty, or an earlier CU folder:
    never a folder of other files (a typo such as `--output-dir .` must not delete anything)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CortexError(f"--output-dir {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file() \
            and not (out_dir / SPECIALIZATIONS_LISTING).is_file():
        raise CortexError(f"--output-dir {out_dir} holds other files (no {MANIFEST}); it would be replaced "
                          "as a whole, so give a new or empty folder")
    if Path(model_path).resolve().is_relative_to(out_dir.resolve()):
        raise CortexError(f"--output-dir {out_dir} contains the model {model_path}; give another folder")


def read_manifest(cu_dir: Path, check_hashes: bool = True) -> dict:
    """The manifest of a CU folder, after checking that every cu.onnx is the one it describes."""
    path = Path(cu_dir) / MANIFEST
    if not Path(cu_dir).is_dir():
        raise CortexError(f"--cu-dir {cu_dir} is not a folder (run 'cortex decompose' first)")
    if not path.is_file():
        raise CortexError(f"{cu_dir} has no {MANIFEST} (is it the --output-dir of 'cortex decompose'?)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CortexError(f"{path}: not a readable manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else None
        raise CortexError(f"{path}: schema is {found!r}, expected {MANIFEST_SCHEMA!r}")
    for key in ("model", "inputs", "outputs", "tensors", "cus"):
        if key not in manifest:
            raise CortexError(f"{path}: missing key {key!r}")
    if check_hashes:
        for cu in manifest["cus"]:
            model = Path(cu_dir) / cu["path"]
            if not model.is_file():
                raise CortexError(f"{path}: {cu['id']} names {cu['path']}, which does not exist")
            if file_sha256(model) != cu["sha256"]:
                raise CortexError(f"{model}: its sha256 differs from the manifest's (stale manifest or edited "
                                  "CU); run 'cortex decompose' again")
    return manifest


def model_info(path: Path, graph: Graph) -> dict:
    return {"path": str(path), "name": graph.name, "sha256": file_sha256(path),
            "opsets": dict(sorted(graph.opset_imports.items()))}


__all__ = ["write_cus", "read_manifest", "model_info", "cu_graph", "cu_id", "dtype_name"]
