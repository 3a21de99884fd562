"""Compile a CU folder (the output of `cortex decompose`) into CUDA artifacts, one set per CU.

Per CU: `cu-NNNN.cu` (one translation unit, `extern "C"` kernels), `cu-NNNN.ptx`, one
`cu-NNNN.sm_XX.cubin` per architecture, and `cu-NNNN.weights` (the weights blob the kernels read).
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
from backends.cuda.render import render_cuda
from cortex.artifacts import read_cus_for_target, read_dag_for_cus, write_dag
from cortex.cus import write_directory_atomically
from ir.errors import CortexError
from ir.loops import lower_graph

RECORD_SCHEMA = "cortex.cuda/1"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
            built = compile_cuda(source.text, f"{cu_id}.cu", archs, compiler)
        except CortexError as e:
            raise type(e)(f"{cu_id} ({cu_dir / cu['path']}): {e}") from None
        files = {f"{cu_id}.cu": source.text.encode(), f"{cu_id}.ptx": built.ptx,
                 f"{cu_id}.weights": source.weights,
                 **{f"{cu_id}.{arch}.cubin": cubin for arch, cubin in built.cubins.items()}}
        entry = lambda name: {"file": name, "sha256": _sha(files[name]), "bytes": len(files[name])}  # noqa: E731
        record = {
            "schema": RECORD_SCHEMA,
            "compiler": built.compiler,
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
            "compiler": next(iter(records.values()))["compiler"] if records else None,
            "spills": sorted(f"{cu}: {k}" for cu, r in records.items() for k in r["spills"]),
            "max_registers": max((res["registers"] for r in records.values() for arch in r["resources"].values()
                                  for res in arch.values()), default=0),
            "bytes": sum(e["bytes"] for r in records.values()
                         for e in [r["source"], r["ptx"], r["weights"], *r["cubins"].values()]),
            "seconds": round(time.perf_counter() - start, 3)}
