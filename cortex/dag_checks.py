"""What a dag.json must hold beyond its JSON Schema before a runtime trusts it.

The schema fixes the types; these are the invariants that relate one part of the document to
another: every CU input is a model input or produced by a CU earlier in `order`; `order` lists
each CU once; every tensor's dtype is one Cortex knows and its bytes match its shape; each
artifact's memory plan fits its memory and agrees with the tensors; every artifact path stays
inside the folder of dag.json, and so does the cu.onnx of a fallback CU (`runs_on`), which is
that CU's artifact. A wasm artifact's alternate modules (`compile-wasm --features A;B`) answer to
the same checks, each with a feature set of its own. Branch CUs of a decomposed If (`cus[i].activation`, `selects`): each
activation tensor is a one-element bool tensor available before the CU in `order`; each select's
tensor is produced by no CU, and each case is a tensor of its shape and dtype produced by a CU
activated on that condition with that value; a tensor of a branch CU is read only by CUs of the
same branch (everyone else reads the select); a select's tensor is available once its condition
and the CUs of all its cases have come in `order`. The source model (`source_model`) usually lies outside the bundle's folder, so its path need
only be relative; whoever runs it checks its sha256 first (`cortex/runtime/offline.py`).
`first_violation` names the first broken one in one line.
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 types with numpy)
import numpy as np

from ir.dtypes import NUMPY_NAMES
from ir.fs import confined_path

# Larger than any tensor a device can hold: such a shape is damage, not a model.
MAX_TENSOR_BYTES = 1 << 40
WASM_MEMORY_LIMIT = 1 << 32


def first_violation(dag: dict, folder: Path) -> str | None:
    for check in (_cu_ids, _tensors, _interface, _branches, _data_flow, _artifacts, _source_model):
        problem = check(dag, folder)
        if problem is not None:
            return problem
    return None


def _cu_ids(dag: dict, folder: Path) -> str | None:
    ids = [cu["id"] for cu in dag["cus"]]
    if len(set(ids)) != len(ids):
        return f"CU {next(i for i in ids if ids.count(i) > 1)} is listed twice"
    if sorted(dag["order"]) != sorted(ids):
        missing = sorted(set(ids) - set(dag["order"])) or sorted(set(dag["order"]) - set(ids))
        return f"'order' does not list every CU exactly once ({missing[0]})"
    return None


def tensor_bytes(dtype: str, shape: list[int]) -> int | None:
    """Bytes of a tensor; None when the dtype is not one Cortex writes."""
    if dtype not in NUMPY_NAMES:
        return None
    return math.prod(shape) * np.dtype(dtype).itemsize


def _tensor_problem(name: str, spec: dict) -> str | None:
    size = tensor_bytes(spec["dtype"], spec["shape"])
    if size is None:
        return f"tensor {name!r} has unknown dtype {spec['dtype']!r}"
    if size > MAX_TENSOR_BYTES:
        return f"tensor {name!r} of shape {spec['shape']} would need {size:,} bytes"
    if "bytes" in spec and spec["bytes"] != size:
        return f"tensor {name!r} says {spec['bytes']} bytes, its shape {spec['shape']} needs {size}"
    return None


def _tensors(dag: dict, folder: Path) -> str | None:
    for name, spec in dag["tensors"].items():
        problem = _tensor_problem(name, spec)
        if problem:
            return problem
    return None


def _interface(dag: dict, folder: Path) -> str | None:
    tensors = dag["tensors"]
    for spec in [*dag["inputs"], *dag["outputs"]]:
        problem = _tensor_problem(spec["name"], spec)
        if problem:
            return problem
        known = tensors.get(spec["name"])
        if known is not None and (known["dtype"], known["shape"]) != (spec["dtype"], spec["shape"]):
            return f"model input/output {spec['name']!r} is {spec['dtype']}{spec['shape']} but its tensor entry " \
                   f"says {known['dtype']}{known['shape']}"
    for cu in dag["cus"]:
        for name in [*cu["inputs"], *cu["outputs"]]:
            if name not in tensors:
                return f"{cu['id']} names tensor {name!r}, which 'tensors' does not describe"
    return None


def _producers(dag: dict) -> dict[str, str]:
    return {name: cu["id"] for cu in dag["cus"] for name in cu["outputs"]}


def _branches(dag: dict, folder: Path) -> str | None:
    tensors, producer = dag["tensors"], _producers(dag)
    cus = {cu["id"]: cu for cu in dag["cus"]}
    selects = dag.get("selects", [])
    for cu in dag["cus"]:
        activation = cu.get("activation")
        if activation is not None:
            spec = tensors.get(activation["tensor"])
            if spec is None or spec["dtype"] != "bool" or math.prod(spec["shape"]) != 1:
                return f"{cu['id']}'s activation tensor {activation['tensor']!r} is not a described one-element bool tensor"
    selected = set()
    for s in selects:
        out = s["tensor"]
        if out in selected or out in producer or out in {spec["name"] for spec in dag["inputs"]}:
            return f"select {out!r} names a tensor that is selected twice, produced by a CU or a model input"
        selected.add(out)
        values = [case["equals"] for case in s["cases"]]
        if len(set(values)) != len(values):
            return f"select {out!r} lists the value {values[0]!r} twice"
        for name in [out, s["condition"], *(case["tensor"] for case in s["cases"])]:
            if name not in tensors:
                return f"select {out!r} names tensor {name!r}, which 'tensors' does not describe"
        for case in s["cases"]:
            t, by = case["tensor"], cus.get(producer.get(case["tensor"]))
            if by is None or by.get("activation") != {"tensor": s["condition"], "equals": case["equals"]}:
                return f"select {out!r}: its case {t!r} is not produced by a CU activated when " \
                       f"{s['condition']!r} is {case['equals']}"
            if (tensors[t]["dtype"], tensors[t]["shape"]) != (tensors[out]["dtype"], tensors[out]["shape"]):
                return f"select {out!r} is {tensors[out]['dtype']}{tensors[out]['shape']} but its case {t!r} is " \
                       f"{tensors[t]['dtype']}{tensors[t]['shape']}"
    for cu in dag["cus"]:
        for name in cu["inputs"]:
            by = cus.get(producer.get(name))
            if by is not None and "activation" in by and by["activation"] != cu.get("activation"):
                return f"{cu['id']} reads {name!r}, which only exists when {by['id']} runs; it must read the select"
    return None


def _data_flow(dag: dict, folder: Path) -> str | None:
    cus = {cu["id"]: cu for cu in dag["cus"]}
    producer: dict[str, str] = {}
    model_inputs = {spec["name"] for spec in dag["inputs"]}
    for cu in dag["cus"]:
        for name in cu["outputs"]:
            if name in producer or name in model_inputs:
                return f"tensor {name!r} is produced twice ({producer.get(name, 'a model input')} and {cu['id']})"
            producer[name] = cu["id"]
    pending = {s["tensor"]: s for s in dag.get("selects", [])}
    ready, passed = set(model_inputs), set()

    def resolve() -> None:
        # A select's tensor is there once its condition is and every case's CU has come.
        while any(_resolvable(s, ready, passed, producer) for s in pending.values()):
            for out in [o for o, s in pending.items() if _resolvable(s, ready, passed, producer)]:
                ready.add(out)
                del pending[out]

    resolve()
    for cu_id in dag["order"]:
        activation = cus[cu_id].get("activation")
        for name in [*cus[cu_id]["inputs"], *([activation["tensor"]] if activation else [])]:
            if name in ready:
                continue
            if name in producer:
                return f"'order' is not topological: {cu_id} reads {name!r} before {producer[name]} produces it"
            if any(s["tensor"] == name for s in dag.get("selects", [])):
                return f"'order' is not topological: {cu_id} reads the select {name!r} before its cases are produced"
            return f"{cu_id} reads {name!r}, which no CU produces and which is not a model input"
        ready.update(cus[cu_id]["outputs"])
        passed.add(cu_id)
        resolve()
    for spec in dag["outputs"]:
        if spec["name"] not in ready:
            return f"model output {spec['name']!r} is produced by no CU"
    return None


def _resolvable(select: dict, ready: set[str], passed: set[str], producer: dict[str, str]) -> bool:
    return select["condition"] in ready and all(producer.get(c["tensor"]) in passed for c in select["cases"])


def _artifacts(dag: dict, folder: Path) -> str | None:
    for cu in dag["cus"]:
        if "runs_on" in cu:
            problem = _outside(folder, cu["path"])
            if problem:
                return f"{cu['id']} (runs on {cu['runs_on']}): {problem}"
        # A variant replaces the CU it belongs to, so its artifacts answer to the same checks.
        owners = [(f"{cu['id']}'s", cu.get("artifacts", {}))]
        owners += [(f"{cu['id']}'s {precision} variant's", v["artifacts"])
                   for precision, v in cu.get("variants", {}).items()]
        for owner, artifacts in owners:
            for check, key in ((_wasm_record, "wasm"), (_cuda_record, "cuda")):
                if key in artifacts:
                    problem = check(cu, artifacts[key], dag["tensors"], folder)
                    if problem:
                        return f"{owner} {key} artifact: {problem}"
    return None


def _source_model(dag: dict, folder: Path) -> str | None:
    record = dag.get("source_model")
    if record is not None and (Path(record["path"]).is_absolute() or "\0" in record["path"]):
        return f"source_model path {record['path']!r} is not relative to the folder of dag.json"
    return None


def _outside(folder: Path, relative: str) -> str | None:
    if confined_path(folder, relative) is None:
        return f"path {relative!r} leaves the folder of dag.json (absolute, '..' or a link out of it)"
    return None


def _same_tensors(kind: str, entries: list[dict], names: list[str], tensors: dict) -> str | None:
    if sorted(e["name"] for e in entries) != sorted(names):
        return f"its {kind} {sorted(e['name'] for e in entries)} are not the CU's {sorted(names)}"
    for e in entries:
        t = tensors[e["name"]]
        if (e["dtype"], e["shape"]) != (t["dtype"], t["shape"]):
            return f"{kind[:-1]} {e['name']!r} is {e['dtype']}{e['shape']}, the tensor is {t['dtype']}{t['shape']}"
        if tensor_bytes(e["dtype"], e["shape"]) != e["bytes"]:
            return f"{kind[:-1]} {e['name']!r} says {e['bytes']} bytes for shape {e['shape']}"
    return None


def _wasm_record(cu: dict, record: dict, tensors: dict, folder: Path) -> str | None:
    problem = _wasm_module(cu, record, tensors, folder)
    if problem:
        return problem
    sets = [record["options"]["features"]]
    for alternate in record.get("alternates", ()):
        label = f"alternate {','.join(alternate['features']) or '(no features)'}"
        if sorted(alternate["features"]) in [sorted(s) for s in sets]:
            return f"{label}: that feature set is already recorded"
        sets.append(alternate["features"])
        # An alternate's plan and weights are the primary's unless it records its own.
        problem = _wasm_module(cu, {"memory": record["memory"], "weights": record.get("weights", ()), **alternate},
                               tensors, folder)
        if problem:
            return f"{label}: {problem}"
    return None


def _wasm_module(cu: dict, record: dict, tensors: dict, folder: Path) -> str | None:
    problem = _outside(folder, record["path"])
    if problem:
        return problem
    memory = record["memory"]
    # A module of a --memory shared build addresses the model's whole memory, not only its region.
    addressable = (memory.get("shared") or {}).get("memory_bytes", memory["memory_bytes"])
    for kind, names in (("inputs", cu["inputs"]), ("outputs", cu["outputs"])):
        problem = _same_tensors(kind, memory[kind], names, tensors)
        if problem:
            return problem
        for e in memory[kind]:
            if e["offset"] + e["bytes"] > addressable:
                return f"{kind[:-1]} {e['name']!r} at offset {e['offset']} (+{e['bytes']} bytes) lies past the " \
                       f"module's {addressable} bytes of memory"
    for w in record.get("weights", ()):
        problem = _outside(folder, w["path"])
        if problem:
            return f"weights {problem}"
        if w["offset"] + w["bytes"] > addressable:
            return f"weights {w['path']!r} at offset {w['offset']} (+{w['bytes']} bytes) lie past the " \
                   f"module's {addressable} bytes of memory"
    return None


def _cuda_record(cu: dict, record: dict, tensors: dict, folder: Path) -> str | None:
    problem = _outside(folder, record["folder"])
    if problem:
        return problem
    weights = record["weights"]
    entries = [record["source"], record["ptx"], *record["cubins"].values(), *weights.get("segments", [weights])]
    for entry in filter(None, entries):
        problem = _outside(folder, f"{record['folder']}/{entry['file']}")
        if problem:
            return problem
    for kind, names in (("inputs", cu["inputs"]), ("outputs", cu["outputs"])):
        params = [p for p in record["params"] if p["kind"] == kind[:-1]]
        problem = _same_tensors(kind, params, names, tensors)
        if problem:
            return problem
    return None
