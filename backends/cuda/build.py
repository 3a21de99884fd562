"""Compile a CU folder (the output of `cortex decompose`) into CUDA artifacts, one set per CU.

Per CU: `cu-NNNN.cu` (one translation unit, `extern "C"` kernels), `cu-NNNN.ptx`, one
`cu-NNNN.sm_XX.cubin` per architecture, and `cu-NNNN.weights` (the weights blob the kernels read).
A CU whose outputs are all empty tensors renders no kernel: it gets its (empty) weights file only,
and its record says `module: false` and each output `empty`, so the devices load nothing for it.
Every CU is checked for ops without a loop-nest lowering before anything is compiled. The files are
written into a temporary sibling of the output folder that replaces it only when every CU compiled;
dag.json, when given, then gets each CU's record (`cus[i].artifacts.cuda`: files and hashes, kernels
with launch geometry and per-arch registers, shared memory and spills, the parameter layout) and is
rewritten atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from backends.cuda.compile import compile_cuda
from backends.cuda.render import CudaSource, render_cuda
from cortex.artifacts import read_cus_for_target, read_dag_for_cus, write_dag
from ir.fs import write_directory_atomically
from ir.errors import CortexError
from ir.loops import lower_graph

RECORD_SCHEMA = "cortex.cuda/1"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _entry(name: str, data: bytes) -> dict:
    return {"file": name, "sha256": _sha(data), "bytes": len(data)}


def _kernel_free_record(cu_id: str, source: CudaSource) -> tuple[dict, dict[str, bytes]]:
    """A CU that renders no kernel: every output is an empty tensor (a view or a copy of another
    tensor is always written by a kernel, since a CU output owns its storage). There is nothing to
    compile or load; the devices allocate the empty outputs and launch nothing. The record says so
    (`module: false`, each output `empty`) and keeps only the weights file, which is empty too."""
    for p in source.params:
        if p.kind == "output" and p.bytes:
            raise CortexError(f"output {p.name!r} ({p.bytes} bytes) is written by no kernel; the CUDA renderer "
                              "dropped its loop nest")
    files = {f"{cu_id}.weights": source.weights}
    record = {
        "schema": RECORD_SCHEMA,
        "compiler": None,
        "module": False,
        "outputs": {p.name: "empty" for p in source.params if p.kind == "output"},
        "source": None,
        "ptx": None,
        "cubins": {},
        "weights": _entry(f"{cu_id}.weights", source.weights),
        "scratch_bytes": source.scratch_bytes,
        "params": [asdict(p) for p in source.params],
        "launches": [],
        "resources": {},
        "spills": [],
    }
    return record, files


def compile_cu_dir(cu_dir: Path, output: Path, archs: Sequence[str], compiler: str = "auto",
                   dag_path: Path | None = None, on_cu: Callable[[str], None] | None = None,
                   jobs: int | None = None) -> dict:
    cu_dir, output = Path(cu_dir), Path(output)
    start = time.perf_counter()
    manifest, graphs = read_cus_for_target(cu_dir, "CUDA")
    dag = read_dag_for_cus(dag_path, manifest, cu_dir) if dag_path is not None else None

    def build_one(cu: dict) -> tuple[dict, dict[str, bytes]]:
        cu_id = cu["id"]
        try:
            source = render_cuda(lower_graph(graphs[cu_id]), prefix=cu_id.replace("-", "") + "_")
            if not source.launches:
                return _kernel_free_record(cu_id, source)
            built = compile_cuda(source.text, f"{cu_id}.cu", archs, compiler)
        except CortexError as e:
            raise type(e)(f"{cu_id} ({cu_dir / cu['path']}): {e}") from None
        files = {f"{cu_id}.cu": source.text.encode(), f"{cu_id}.ptx": built.ptx,
                 f"{cu_id}.weights": source.weights,
                 **{f"{cu_id}.{arch}.cubin": cubin for arch, cubin in built.cubins.items()}}
        entry = lambda name: _entry(name, files[name])  # noqa: E731
        record = {
            "schema": RECORD_SCHEMA,
            "compiler": built.compiler,
            "module": True,
            "outputs": {p.name: "kernels" if p.bytes else "empty" for p in source.params if p.kind == "output"},
            "source": entry(f"{cu_id}.cu"),
            "ptx": {**entry(f"{cu_id}.ptx"), "arch": built.ptx_arch},
            "cubins": {arch: entry(f"{cu_id}.{arch}.cubin") for arch in built.cubins},
            "weights": entry(f"{cu_id}.weights"),
            "scratch_bytes": source.scratch_bytes,
            "params": [asdict(p) for p in source.params],
            "launches": [{**asdict(launch), "shared_bytes": 0} for launch in source.launches],
            "resources": built.resources_json(),
            "spills": built.spilling_kernels(),
        }
        return record, files

    def fill(folder: Path) -> dict:
        with ThreadPoolExecutor(max_workers=jobs or min(4, os.cpu_count() or 1)) as pool:
            results = list(pool.map(build_one, manifest["cus"]))
        records = {}
        for cu, (record, files) in zip(manifest["cus"], results):
            for name, data in files.items():
                (folder / name).write_bytes(data)
            records[cu["id"]] = record
            if on_cu:
                on_cu(cu["id"])
        index = {"schema": RECORD_SCHEMA, "archs": list(archs), "cus": records}
        (folder / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        return records

    records = write_directory_atomically(output, fill)
    if dag is not None:
        base = Path(os.path.relpath(output.resolve(), dag_path.resolve().parent)).as_posix()
        for cu in dag["cus"]:
            cu.setdefault("artifacts", {})["cuda"] = {**records[cu["id"]], "folder": base}
        write_dag(dag, dag_path)
    kernels = sum(len(r["launches"]) for r in records.values())
    return {"output": str(output), "dag": str(dag_path) if dag_path else None, "cus": len(records),
            "kernels": kernels, "archs": list(archs),
            "compiler": next((r["compiler"] for r in records.values() if r["compiler"]), None),
            "spills": sorted(f"{cu}: {k}" for cu, r in records.items() for k in r["spills"]),
            "max_registers": max((res["registers"] for r in records.values() for arch in r["resources"].values()
                                  for res in arch.values()), default=0),
            "bytes": sum(e["bytes"] for r in records.values()
                         for e in [r["source"], r["ptx"], r["weights"], *r["cubins"].values()] if e),
            "seconds": round(time.perf_counter() - start, 3)}
