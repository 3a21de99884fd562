"""Shared helpers for the CUDA model tests: the CLI pipeline decompose -> build-dag -> compile-cuda,
as functions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from backends.cuda import device as cuda_device
from backends.cuda.build import CudaOptions
from backends.cuda.toolchain import choose_compiler
from backends.registry import target
from cortex.compile import compile_cu_dir
from cortex.commands.decompose import decompose_model
from cortex.dag import build_dag
from ir.errors import CortexError
from ir.fs import write_bytes_atomically
from passes.partition import PartitionIntoCUs


def cuda_compiler_available() -> bool:
    """nvcc or NVRTC is there (no GPU needed: cuda-sim runs what they build)."""
    try:
        choose_compiler("auto")
        return True
    except CortexError:
        return False


def compile_cuda_pipeline(case, out_dir, compiler="auto", archs=("sm_80", "sm_90"), min_cu_size=4096,
                          max_cu_size=50_000_000, max_cu_depth=8) -> Path:
    """Returns the dag.json path with `artifacts.cuda` filled in."""
    out_dir = Path(out_dir)
    decompose_model(Path(case.path), out_dir / "cus", PartitionIntoCUs(min_cu_size, max_cu_size, max_cu_depth),
                    input_shapes=case.input_shapes, dims=case.dims)
    dag_path = out_dir / "dag.json"
    write_bytes_atomically(dag_path, json.dumps(build_dag(out_dir / "cus", dag_path), indent=2).encode())
    compile_cu_dir(target("cuda"), out_dir / "cus", out_dir / "cuda-bin", CudaOptions(tuple(archs), compiler), dag_path)
    return dag_path


def check_each_cu_against_onnxruntime(dag_path: Path, inputs: dict, rtol: float, atol: float, seed: int = 0) -> dict:
    """Run every CU on cuda-sim next to onnxruntime on the same CU model, feeding both the reference
    values, so a mismatch names its CU; returns each CU's largest |output| (to see that values are not
    trivially small)."""
    import numpy as np
    import onnxruntime as ort

    from backends.cuda.runner import CuRunner
    from testdata import assert_values_close

    dag_path = Path(dag_path)
    dag = json.loads(dag_path.read_text())
    cus = {cu["id"]: cu for cu in dag["cus"]}
    env, magnitudes = dict(inputs), {}
    for cu_id in dag["order"]:
        cu = cus[cu_id]
        record = cu["artifacts"]["cuda"]
        cu_model = dag_path.parent / cu["path"]   # dag.json paths are relative to its folder
        session = ort.InferenceSession(str(cu_model), providers=["CPUExecutionProvider"])
        feeds = {i.name: env[i.name] for i in session.get_inputs()}
        expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        got = CuRunner(None, record, dag_path.parent / record["folder"], seed=seed, host_threads=2).run(feeds)
        for name, want in expected.items():
            try:
                assert_values_close(got[name], want, rtol=rtol, atol=atol)
            except AssertionError as e:
                raise AssertionError(f"{cu_id} ({', '.join(cu['op_types'])}) output {name!r}: {e}") from None
        magnitudes[cu_id] = max(float(np.abs(v).max()) if v.size else 0.0 for v in expected.values())
        env.update(expected)
    return magnitudes


def run_cuda_sim(model, feeds: dict, seed: int = 0, with_source: bool = False, **render_options):
    """One ONNX model as one CU: loop nests -> CUDA C++ -> cuda-sim; returns outputs by name (and the
    CUDA source, with `with_source`). `render_options` go to `render_cuda` (tiled=, epilogues=)."""
    from backends.cuda.render import render_cuda
    from codegen.lower import lower_graph
    from ir.onnx_import import import_model
    from passes import optimize_pipeline, run_pipeline

    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    source = render_cuda(lower_graph(graph), "k", **render_options)
    outputs = run_cuda_source(source, feeds, seed)
    return (outputs, source.text) if with_source else outputs


def run_cuda_source(source, feeds: dict, seed: int = 0, text: str | None = None) -> dict:
    """A rendered CudaSource on cuda-sim (with `text` in place of its source, to run an edited one)."""
    import hashlib
    import tempfile
    from dataclasses import asdict

    import numpy as np

    from backends.cuda.runner import CuRunner

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "cu.cu").write_text(source.text if text is None else text)
        (folder / "cu.weights").write_bytes(source.weights)
        record = {"params": [asdict(p) for p in source.params], "launches": [asdict(l) for l in source.launches],
                  "weights": {"file": "cu.weights", "bytes": len(source.weights),
                              "sha256": hashlib.sha256(source.weights).hexdigest()},
                  "scratch_bytes": source.scratch_bytes, "source": {"file": "cu.cu"}}
        results = CuRunner(None, record, folder, seed=seed, host_threads=2).run(feeds)
        return {name: np.array(value) for name, value in results.items()}


class HostMemoryGpu:
    """A stand-in for CudaDevice with the same methods, whose "device memory" is host memory and whose
    modules run under cuda-sim: it lets the `cuda` runtime path run where there is no GPU."""

    def __init__(self, sources_by_ptx: dict):
        self.sources_by_ptx = sources_by_ptx
        self.arrays, self.uploads, self.downloads = [], 0, 0

    def alloc(self, nbytes):
        array = np.zeros(max(1, nbytes), np.uint8)
        self.arrays.append(array)
        return cuda_device.DeviceBuffer(array.ctypes.data, nbytes)

    def upload(self, array, buffer=None):
        array = np.ascontiguousarray(array)
        buffer = buffer or self.alloc(array.nbytes)
        self.uploads += 1
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * max(1, array.nbytes)).from_address(buffer.ptr))[:array.nbytes] = \
            array.view(np.uint8).reshape(-1)
        return buffer

    def download(self, buffer, shape, dtype):
        self.downloads += 1
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = (np.ctypeslib.ctypes.c_uint8 * max(1, count)).from_address(buffer.ptr)
        return np.frombuffer(bytes(raw)[:count], dtype).reshape(shape).copy()

    def load_module(self, cubins, ptx, signatures):
        import hashlib
        from backends.cuda.sim import SimModule
        module = SimModule(self.sources_by_ptx[hashlib.sha256(ptx).hexdigest()])

        class Module:
            def kernel(self, name):
                sim = module.kernel(name)

                class Kernel:
                    def launch(self, grid, block, shared, args, **_):
                        sim.launch(grid, block, shared, [a.ptr if isinstance(a, cuda_device.DeviceBuffer) else a for a in args])
                return Kernel()
        return Module()
