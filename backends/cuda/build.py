"""The CUDA target: one CU's graph -> CUDA C++, PTX, cubins and weights, and its record.

Per CU: `cu-NNNN.cu` (one translation unit, `extern "C"` kernels), `cu-NNNN.ptx`, one
`cu-NNNN.sm_XX.cubin` per architecture, and `cu-NNNN.weights` (the weights blob the kernels read);
with `--external-weights` each file is named by its content instead (`content_addressed.py`).
A CU whose outputs are all empty tensors renders no kernel: it gets its (empty) weights file only,
and its record says `module: false` and each output `empty`, so the devices load nothing for it.
The record (`cus[i].artifacts.cuda`) holds the files and hashes, the kernels with launch geometry
and per-arch registers, shared memory and spills, and the parameter layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import ml_dtypes
import numpy as np

from backends.cuda.content_addressed import file_entries, module_name, weight_segment_files
from backends.cuda.kernels import CudaContractionKernels
from backends.cuda.render import CudaSource, render_cuda
from backends.cuda.tensor_cores import PRECISIONS, TILES
from backends.cuda.toolchain import (
    COMPILERS,
    DEFAULT_ARCHS,
    choose_compiler,
    compile_cuda,
    find_nvcc,
    nvcc_version,
    nvrtc_version,
    parse_archs,
)
from backends.registry import BuiltCU
from codegen.lower import lower_graph
from ir import dtypes
from ir.bounds import length_name
from ir.errors import CortexError
from ir.fs import sha256_bytes
from ir.graph import Graph
from ir.loops.program import Program
from ir.options import option

RECORD_SCHEMA = "cortex.cuda/1"
NARROW_STORAGE = {dtypes.from_numpy(np.float16): "fp16", dtypes.from_numpy(np.dtype(ml_dtypes.bfloat16)): "bf16"}


def _sha(data: bytes) -> str:
    return sha256_bytes(data)


def _entry(name: str, data: bytes) -> dict:
    return {"file": name, "sha256": _sha(data), "bytes": len(data)}


def _kernel_free_record(cu_id: str, source: CudaSource, external: bool) -> tuple[dict, dict[str, bytes]]:
    """A CU that renders no kernel: every output is an empty tensor (a view or a copy of another
    tensor is always written by a kernel, since a CU output owns its storage). There is nothing to
    compile or load; the devices allocate the empty outputs and launch nothing. The record says so
    (`module: false`, each output `empty`) and keeps only the weights file, which is empty too."""
    for p in source.params:
        if p.kind == "output" and p.bytes:
            raise CortexError(f"output {p.name!r} ({p.bytes} bytes) is written by no kernel; the CUDA renderer "
                              "dropped its loop nest")
    files, weights = _weights(cu_id, source, external)
    record = {
        "schema": RECORD_SCHEMA,
        "compiler": None,
        "module": False,
        "outputs": {p.name: "empty" for p in source.params if p.kind == "output"},
        "source": None,
        "ptx": None,
        "cubins": {},
        "weights": weights,
        "scratch_bytes": source.scratch_bytes,
        "params": [asdict(p) for p in source.params],
        "launches": [],
        "resources": {},
        "spills": [],
    }
    return record, files


@dataclass(frozen=True)
class CudaOptions:
    arch: tuple[str, ...] = field(default=DEFAULT_ARCHS, metadata=option(
        "Comma-separated GPU architectures for cubins.", parse=parse_archs, show=",".join))
    compiler: str = field(default="auto", metadata=option(
        f"One of {', '.join(COMPILERS)} (auto: nvcc when installed, else NVRTC).", choices=COMPILERS))
    precision: str = field(default="exact", metadata=option(
        "Input precision of the tensor-core GEMM/Conv kernels: exact (float32 FMA, no tensor cores), tf32, "
        "fp16 or bf16 (rounded inputs, float32 sums; float32 contractions of at least 16x16x16 only).",
        choices=PRECISIONS))
    tensor_core_tile: str = field(default="auto", metadata=option(
        "Block tiling of the tensor-core kernels: auto (by problem size), one of the named block tiles, or "
        "single (one 16x16 tile per warp, one pipeline stage: the first kernel, to compare against).",
        choices=TILES))
    external_weights: bool = field(default=False, metadata=option(
        "Name every file by its content: modules/<sha256>.cu, .ptx and .sm_XX.cubin, and one "
        "weights/<sha256>.bin per weight tensor, so identical code and weights are stored once (always on "
        "for shape specializations)."))


def _has_tensor_cores(arch: str) -> bool:
    """sm_80 or newer: what tf32 and bf16 fragments need (fp16 would do with sm_70)."""
    return int(arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz")) >= 80


def check_toolchain(options: CudaOptions) -> None:
    choose_compiler(options.compiler)   # fail before any work when no compiler is usable
    old = [arch for arch in options.arch if options.precision != "exact" and not _has_tensor_cores(arch)]
    if old:   # tf32 and bf16 fragments need sm_80; one rule for all three keeps the option simple
        raise CortexError(f"--precision {options.precision} needs tensor cores of sm_80 or newer; "
                          f"--arch has {', '.join(old)}")


def stored_weight_precision(graph: Graph) -> str:
    """fp16 or bf16 when the graph's weights are stored narrow and widened by a Cast (a `--variants`
    build, passes/narrow_weights.py), else exact."""
    for node in graph.nodes:
        source = node.inputs[0] if node.op_type == "Cast" and node.inputs else None
        if source is not None and source.is_const and source.dtype in NARROW_STORAGE:
            return NARROW_STORAGE[source.dtype]
    return "exact"


def toolchain_name(options: CudaOptions) -> str:
    """The compiler and version these options resolve to here (`auto` differs between machines)."""
    chosen = choose_compiler(options.compiler)
    return f"nvcc {nvcc_version(find_nvcc())} {find_nvcc()}" if chosen == "nvcc" else f"nvrtc {nvrtc_version()}"


def build_cu(graph: Graph, options: CudaOptions, cu_id: str) -> BuiltCU:
    return _compiled(cu_id, options, *_rendered(graph, options, cu_id))


def check_tf32_variant(options: CudaOptions) -> None:
    """`--variants tf32` before any work: its kernels need sm_80, and it differs from the exact CU
    only where the exact CU keeps float32 FMA."""
    if options.precision != "exact":
        raise CortexError(f"--variants tf32 is a tensor-core build of the exact CUs; with --precision "
                          f"{options.precision} the CUs are not exact (leave --precision at exact)")
    old = [arch for arch in options.arch if not _has_tensor_cores(arch)]
    if old:
        raise CortexError(f"--variants tf32 needs tensor cores of sm_80 or newer; --arch has {', '.join(old)}")


def build_tf32_variant(graph: Graph, options: CudaOptions, cu_id: str) -> BuiltCU | None:
    """The CU with its weights as they are (float32) and every contraction that `--precision tf32`
    would put on tensor cores there; None when it has none (the variant would be the exact CU)."""
    options = replace(options, precision="tf32")
    program, source, precision = _rendered(graph, options, cu_id)
    if not source.tensor_cores:
        return None
    return _compiled(cu_id, options, program, source, precision)


def _rendered(graph: Graph, options: CudaOptions, cu_id: str) -> tuple[Program, CudaSource, str]:
    program = lower_graph(graph, CudaContractionKernels(options.arch))
    # A variant whose weights are already rounded to fp16 or bf16 also rounds the other operand on
    # tensor cores: `cortex calibrate` measures the two roundings together in the variant's trust.
    precision = options.precision
    if precision == "exact" and all(_has_tensor_cores(arch) for arch in options.arch):
        precision = stored_weight_precision(graph)
    source = render_cuda(program, prefix=cu_id.replace("-", "") + "_", precision=precision,
                         tensor_core_tile=options.tensor_core_tile)
    return program, source, precision


def _compiled(cu_id: str, options: CudaOptions, program: Program, source: CudaSource, precision: str) -> BuiltCU:
    if not source.launches:
        record, files = _kernel_free_record(cu_id, source, options.external_weights)
        return BuiltCU(files, record)
    built = compile_cuda(source.text, f"{cu_id}.cu", options.arch, options.compiler)
    text = source.text.encode()
    names = {"source": f"{cu_id}.cu", "ptx": f"{cu_id}.ptx", **{arch: f"{cu_id}.{arch}.cubin" for arch in built.cubins}}
    if options.external_weights:
        names = {"source": module_name(text, ".cu"), "ptx": module_name(built.ptx, ".ptx"),
                 **{arch: module_name(cubin, f".{arch}.cubin") for arch, cubin in built.cubins.items()}}
    files = {names["source"]: text, names["ptx"]: built.ptx,
             **{names[arch]: cubin for arch, cubin in built.cubins.items()}}
    weight_files, weights = _weights(cu_id, source, options.external_weights)
    files.update(weight_files)
    entry = lambda name: _entry(name, files[name])  # noqa: E731
    record = {
        "schema": RECORD_SCHEMA,
        "compiler": built.compiler,
        "module": True,
        "outputs": {p.name: "kernels" if p.bytes else "empty" for p in source.params if p.kind == "output"},
        "source": entry(names["source"]),
        "ptx": {**entry(names["ptx"]), "arch": built.ptx_arch},
        "cubins": {arch: entry(names[arch]) for arch in built.cubins},
        "weights": weights,
        "scratch_bytes": source.scratch_bytes,
        "params": [asdict(p) for p in source.params],
        "launches": [{**asdict(launch), "shared_bytes": 0} for launch in source.launches],
        "resources": built.resources_json(),
        "spills": built.spilling_kernels(),
    }
    if precision != "exact":   # what was asked for (or the variant's weights), and the kernels that got it
        record["precision"] = {"requested": precision, "tensor_cores": source.tensor_cores}
    if program.bounds:   # data-dependent lengths (ir/bounds.py): which params carry them
        record["bounds"] = {name: {"axis": axis, "length": length_name(name)}
                            for name, (axis, _) in program.bounds.items()}
    return BuiltCU(files, record)


def _weights(cu_id: str, source: CudaSource, external: bool) -> tuple[dict[str, bytes], dict]:
    """The weights' files and the record's entry: one blob, or one content-addressed file per weight."""
    if external:
        return weight_segment_files(source.weights, source.weight_segments)
    return {f"{cu_id}.weights": source.weights}, _entry(f"{cu_id}.weights", source.weights)


def place(record: dict, folder: str) -> dict:
    return {**record, "folder": folder}


def summarize(records: dict[str, dict], options: CudaOptions) -> dict:
    return {
        "kernels": sum(len(r["launches"]) for r in records.values()),
        "archs": list(options.arch),
        "compiler": next((r["compiler"] for r in records.values() if r["compiler"]), None),
        "spills": sorted(f"{cu}: {k}" for cu, r in records.items() for k in r["spills"]),
        "max_registers": max((res["registers"] for r in records.values() for arch in r["resources"].values()
                              for res in arch.values()), default=0),
        # As stored: a content-addressed file several CUs (or specializations) name counts once.
        "bytes": sum({e["file"]: e["bytes"] for r in records.values() for e in file_entries(r)}.values()),
    }
