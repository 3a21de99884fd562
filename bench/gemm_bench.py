"""GEMM micro-benchmarks: Cortex's WASM GEMM kernel under wasmtime and under V8, against
onnxruntime's MatMul (native, one thread) and onnxruntime-web's, plus the WASM SIMD peak measured by
an FMA loop in the same run (so "fraction of peak" compares like with like).

`python -m bench.gemm_bench [--rounds N]` prints the table (`make bench` also writes it into
docs/benchmarks.md); without onnxruntime-web installed the V8 columns are left out.
`python -m bench.gemm_bench --epilogues` instead times the kernel under wasmtime on the models'
product shapes with each epilogue (bias, bias + relu, bias + gelu, residual, none)."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import wasmtime
from onnx import TensorProto, helper, numpy_helper

from backends.wasm.gemm import SIMD, SIMD_FMA, gemm_scratch_bytes, pack_b, packed_b_size, render_gemm
from backends.wasm.kernels.operands import GemmLayout, GemmOffsets
from backends.wasm.kernels.standalone import engine_for, instantiate, module_text, read, write
from bench.node_runner import NodeContestant, NodeRunner, NodeUnavailable
from bench.timing import InProcess, Timings, interleave, repeats_for
from ir.loops.contraction import EpilogueSpec, GemmSpec

SHAPES = ((64, 64, 64), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (1, 3072, 768))  # m, n, k
PEAK_ITERATIONS = 2_000_000
PEAK_ACCUMULATORS = 12  # independent FMA chains: enough to cover latency x ports on current cores


def peak_wat(fma: bool) -> str:
    """A loop of independent v128 multiply-adds and nothing else: what the engine can issue at best."""
    regs = [f"$c{i}" for i in range(PEAK_ACCUMULATORS)]
    madd = ("(f32x4.relaxed_madd (local.get {r}) (local.get $x) (local.get $y))" if fma
            else "(f32x4.add (f32x4.mul (local.get {r}) (local.get $x)) (local.get $y))")
    body = "\n".join(f"    (local.set {r} {madd.format(r=r)})" for r in regs)
    total = "(local.get $c0)"
    for r in regs[1:]:
        total = f"(f32x4.add {total} (local.get {r}))"
    return f"""(func $peak (param $n i32)
  (local $x v128) (local $y v128) {' '.join(f'(local {r} v128)' for r in regs)}
  (local.set $x (v128.const f32x4 0.999 0.999 0.999 0.999))
  (local.set $y (v128.const f32x4 0.001 0.001 0.001 0.001))
  (loop $l
{body}
    (local.set $n (i32.sub (local.get $n) (i32.const 1)))
    (br_if $l (local.get $n)))
  (v128.store (i32.const 0) {total}))
"""


_REPEAT = """(func $repeat (param $n i32)
  (loop $again
    (call $gemm)
    (local.set $n (i32.sub (local.get $n) (i32.const 1)))
    (br_if $again (local.get $n))))
"""


def peak_flops_per_call() -> float:
    return PEAK_ITERATIONS * PEAK_ACCUMULATORS * 4 * 2


@dataclass
class GemmResult:
    shape: tuple[int, int, int]
    gflops: dict[str, float] = field(default_factory=dict)       # contestant -> GFLOP/s at the median
    timings: dict[str, Timings] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    calls: int = 1  # kernel calls per timed Cortex run

    def to_json(self) -> dict:
        return {"m_n_k": list(self.shape), "gflops": self.gflops, "errors": self.errors, "cortex_calls_per_run": self.calls,
                "timings": {k: t.to_json() for k, t in self.timings.items()}}


def _matmul_model(b: np.ndarray, m: int, path: Path) -> None:
    k, n = b.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])],
                              [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime-web 1.30 reads IR versions up to 13 only
    onnx.save(model, path)


def _ort_session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def bench_gemm(shape, node: NodeRunner | None, workdir: Path, rounds: int) -> GemmResult:
    m, n, k = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    result = GemmResult(shape)
    offsets = {"a": 0, "b": a.nbytes, "c": a.nbytes + packed_b_size(k, n)}
    offsets["scratch"] = offsets["c"] + m * n * 4
    end = offsets["scratch"] + gemm_scratch_bytes(m, k)
    contestants = []
    expected = a @ b
    flops = 2.0 * m * n * k
    # Small products take microseconds, less than a call from Python into wasmtime costs: a run of
    # the Cortex kernel is `calls` calls from a loop inside the module (the same under V8).
    calls = max(1, int(-(-20e6 // flops)))
    for label, features in (("cortex-wasmtime", SIMD_FMA), ("cortex-wasmtime-simd", SIMD)):
        func = render_gemm(GemmSpec(m, n, k), GemmOffsets(offsets["a"], offsets["b"], offsets["c"],
                                                          a_scratch=offsets["scratch"]), features=features)
        func += _REPEAT
        store, inst = instantiate(func, end, features)
        write(store, inst, offsets["a"], a)
        write(store, inst, offsets["b"], pack_b(b))
        gemm = inst.exports(store)["gemm"]
        gemm(store)
        got = read(store, inst, offsets["c"], (m, n))
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * k ** 0.5)  # never time a wrong kernel
        repeat_gemm = inst.exports(store)["repeat"]
        contestants.append(InProcess(label, lambda g=repeat_gemm, s=store: g(s, calls)))
        if features == SIMD_FMA:
            wasm_bytes = wasmtime.wat2wasm(module_text(func, end))
    model = workdir / f"matmul_{m}x{n}x{k}.onnx"
    _matmul_model(b, m, model)
    session = _ort_session(model)
    contestants.append(InProcess("ort-cpu", lambda: session.run(None, {"a": a})))
    if node is not None:
        (workdir / "a.bin").write_bytes(a.tobytes())
        (workdir / "b.bin").write_bytes(pack_b(b))
        wasm_path = workdir / f"gemm_{m}x{n}x{k}.wasm"
        wasm_path.write_bytes(wasm_bytes)
        tag = f"{m}x{n}x{k}"
        for label, request in (
            ("cortex-v8", dict(cmd="wasm", id=f"v8-{tag}", module=str(wasm_path), export="repeat", args=[calls],
                               data=[[offsets["a"], str(workdir / "a.bin")], [offsets["b"], str(workdir / "b.bin")]])),
            ("ort-web", dict(cmd="load", id=f"web-{tag}", model=str(model),
                             inputs=[{"name": "a", "dtype": "float32", "shape": [m, k], "data": str(workdir / "a.bin")}])),
        ):
            try:
                node.ask(**request)
                contestants.append(NodeContestant(label, node, request["id"]))
            except RuntimeError as e:
                result.errors[label] = str(e)
    repeat = repeats_for(flops / 20e9)
    result.timings = interleave(contestants, rounds, repeat, warmup=2)
    for name, t in result.timings.items():
        per_run = flops * (calls if name.startswith("cortex") else 1)
        result.gflops[name] = per_run / t.median / 1e9
    result.calls = calls
    return result


def bench_peak(node: NodeRunner | None, workdir: Path, rounds: int = 3) -> dict[str, float]:
    """GFLOP/s of the FMA loop (relaxed SIMD) and the mul+add loop (plain SIMD), wasmtime and V8."""
    found = {}
    for label, fma in (("wasmtime-fma", True), ("wasmtime-mul-add", False)):
        features = SIMD_FMA if fma else SIMD
        store, inst = instantiate(peak_wat(fma), 64, features)
        peak = inst.exports(store)["peak"]
        t = interleave([InProcess(label, lambda p=peak, s=store: p(s, PEAK_ITERATIONS))], rounds, 3)[label]
        found[label] = peak_flops_per_call() / t.best / 1e9
    if node is not None:
        path = workdir / "peak.wasm"
        path.write_bytes(wasmtime.wat2wasm(module_text(peak_wat(True), 64)))
        node.ask(cmd="wasm", id="peak", module=str(path), export="peak", args=[PEAK_ITERATIONS])
        t = Timings()
        t.add(NodeContestant("v8-fma", node, "peak").time(2, 3 * rounds))
        found["v8-fma"] = peak_flops_per_call() / t.best / 1e9
    return found


def run_all(node: NodeRunner | None, rounds: int = 5, shapes=SHAPES, log=print) -> tuple[list[GemmResult], dict]:
    engine_for(SIMD_FMA)  # fail early if this wasmtime lacks relaxed SIMD
    with tempfile.TemporaryDirectory(prefix="cortex-bench-gemm-") as tmp:
        peak = bench_peak(node, Path(tmp))
        log("  peak: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items()))
        results = []
        for shape in shapes:
            r = bench_gemm(shape, node, Path(tmp), rounds)
            log(f"  gemm {'x'.join(map(str, shape))}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.gflops.items())
                + " GFLOP/s" + "".join(f"; {k}: {e}" for k, e in r.errors.items()))
            results.append(r)
    return results, peak


# (m, n, k), bias per row: square products, MiniLM's MatMuls (128 tokens), and im2col Convs
# (output channels x pixels x in-channels * kernel area) whose bias is per output channel, a row of C
EPILOGUE_SHAPES = (((512, 512, 512), False), ((256, 256, 256), False), ((128, 384, 384), False),
                   ((128, 1536, 384), False), ((128, 384, 1536), False), ((64, 3136, 576), True),
                   ((256, 784, 1152), True))
EPILOGUE_CASES = {"bias": dict(bias=True), "bias+relu": dict(bias=True, epilogue="relu"),
                  "bias+gelu": dict(bias=True, epilogue="gelu"), "residual": dict(residual=True), "plain": {}}


def bench_epilogue(shape, per_row: bool, case: str, features=SIMD_FMA, rounds: int = 5) -> float:
    """GFLOP/s (median CPU time) of C = act(A @ B + bias + residual) under wasmtime, A packed."""
    m, n, k = shape
    opts = EPILOGUE_CASES[case]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    bias, res = rng.standard_normal(m if per_row else n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    offsets, end = {}, 0
    for key, size in (("a", a.nbytes), ("b", packed_b_size(k, n)), ("c", m * n * 4), ("res", m * n * 4),
                      ("bias", bias.nbytes), ("scratch", gemm_scratch_bytes(m, k))):
        offsets[key], end = end, end + size
    epilogue = EpilogueSpec(bool(opts.get("bias")), bool(opts.get("residual")), opts.get("epilogue"))
    spec = GemmSpec(m, n, k, epilogue=epilogue)
    at = GemmOffsets(0, offsets["b"], offsets["c"], bias=offsets["bias"] if opts.get("bias") else None,
                     residual=offsets["res"] if opts.get("residual") else None, a_scratch=offsets["scratch"])
    func = render_gemm(spec, at, features=features, layout=GemmLayout(bias_per_row=per_row)) + _REPEAT
    store, inst = instantiate(func, end, features)
    for key, value in (("a", a), ("b", pack_b(b)), ("bias", bias), ("res", res)):
        write(store, inst, offsets[key], value)
    inst.exports(store)["gemm"](store)
    want = a.astype(np.float64) @ b + (bias[:, None] if per_row else bias) * bool(opts.get("bias"))
    want = want + res * bool(opts.get("residual"))
    if opts.get("epilogue") is None:  # never time a wrong kernel (the activations have tests of their own)
        np.testing.assert_allclose(read(store, inst, offsets["c"], (m, n)), want, rtol=1e-3, atol=1e-3 * k ** 0.5)
    flops = 2.0 * m * n * k
    calls = max(1, int(-(-20e6 // flops)))
    repeat_gemm = inst.exports(store)["repeat"]
    t = interleave([InProcess(case, lambda: repeat_gemm(store, calls))], rounds, repeats_for(flops * calls / 40e9), warmup=2)
    return flops * calls / t[case].median / 1e9


def run_epilogues(rounds: int, log=print) -> None:
    for shape, per_row in EPILOGUE_SHAPES:
        log(f"  {'x'.join(map(str, shape)):13s} " + "  ".join(
            f"{case} {bench_epilogue(shape, per_row, case, rounds=rounds):.1f}" for case in EPILOGUE_CASES) + " GFLOP/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epilogues", action="store_true", help="time the epilogue products (wasmtime only)")
    args = parser.parse_args(argv)
    if args.epilogues:
        run_epilogues(args.rounds)
        return 0
    try:
        node = NodeRunner()
    except (NodeUnavailable, OSError) as e:
        print(f"  V8 columns left out: {e}")
        node = None
    try:
        run_all(node, rounds=args.rounds)
    finally:
        if node is not None:
            node.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
