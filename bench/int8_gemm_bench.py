"""The integer GEMM (kernels/int8_gemm.py) against the float32 GEMM (gemm.py) under wasmtime, on the
same shapes, interleaved: GOPS (2 * M * N * K operations per product per second, at the median).

`python -m bench.int8_gemm_bench [--rounds N]` prints one line per shape. Contestants: the float
GEMM with relaxed SIMD (FMA) and with plain SIMD, the integer GEMM with int32 output
(MatMulInteger), requantised to uint8 (QLinearMatMul) and dequantised to float32 with a bias
(MatMulIntegerToFloat, dynamically quantized MiniLM's form), the relaxed-SIMD 8-bit kernel on
7-bit weights (int32 output), and onnxruntime's MatMulInteger (native, one thread) for scale.
`--shapes minilm` runs MiniLM-L6's products at sequence length 128 only."""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from backends.wasm.gemm import SIMD, SIMD_FMA, gemm_scratch_bytes, pack_b, packed_b_size, render_gemm
from backends.wasm.kernels.int8_gemm import IntegerGemmOffsets, render_integer_gemm, scratch_bytes
from backends.wasm.kernels.int8_gemm import pack_b as pack_integer_b
from backends.wasm.kernels.operands import GemmOffsets
from backends.wasm.kernels.standalone import instantiate, write
from bench.timing import InProcess, interleave, repeats_for
from ir.loops.contraction import DequantizeSpec, GemmSpec, IntegerGemmSpec, RequantizeSpec

SHAPES = ((512, 512, 512), (16, 384, 384), (16, 384, 1536), (16, 1536, 384))   # m, n, k
MINILM_SHAPES = ((128, 384, 384), (128, 1536, 384), (128, 384, 1536))   # attention, FFN up, FFN down


def _repeat(name: str) -> str:
    return f"""(func $repeat (param $n i32)
  (loop $again
    (call ${name})
    (local.set $n (i32.sub (local.get $n) (i32.const 1)))
    (br_if $again (local.get $n))))
"""


def _float_contestant(label, a, b, features, calls):
    m, k = a.shape
    n = b.shape[1]
    at = GemmOffsets(0, a.nbytes, a.nbytes + packed_b_size(k, n), a_scratch=a.nbytes + packed_b_size(k, n) + m * n * 4)
    end = at.a_scratch + gemm_scratch_bytes(m, k)
    store, inst = instantiate(render_gemm(GemmSpec(m, n, k), at, features=features) + _repeat("gemm"), end, features)
    write(store, inst, at.a, a)
    write(store, inst, at.b_packed, pack_b(b))
    repeat = inst.exports(store)["repeat"]
    return InProcess(label, lambda: repeat(store, calls))


def integer_contestant(label, a, b, requantize, calls, relaxed=False, dequantize=False):
    m, k = a.shape
    n = b.shape[1]
    span = int((b.astype(np.int32).max(0) - b.astype(np.int32).min(0)).max())
    spec = IntegerGemmSpec(m, n, k, b_column_span=span, requantize=RequantizeSpec() if requantize else None,
                           dequantize=DequantizeSpec(bias=True) if dequantize else None)
    packed_a, tile, scales = scratch_bytes(spec, relaxed)
    packed_b = pack_integer_b(b.astype(np.int32), relaxed).tobytes()
    offsets, end = [], 64
    for size in (a.nbytes, len(packed_b), m * n * 4, packed_a, tile, max(scales, 16), 16, 16, 16, 16, 16, 4 * n):
        offsets.append(end)
        end += size + 64
    a_at, b_at, c_at, pa_at, tile_at, scales_at, za_at, as_at, bs_at, ys_at, yz_at, bias_at = offsets
    at = IntegerGemmOffsets(a_at, b_at, c_at, pa_at, tile_at, a_zero=za_at,
                            **({"scales": scales_at, "a_scale": as_at, "b_scale": bs_at, "out_scale": ys_at, "out_zero": yz_at}
                               if requantize else {}),
                            **({"dequantize_scale": as_at, "bias": bias_at} if dequantize else {}))
    features = {"simd", "relaxed-simd"} if relaxed else {"simd"}
    store, inst = instantiate(render_integer_gemm(spec, at, relaxed=relaxed) + _repeat("igemm"), end, features)
    memory = inst.exports(store)["memory"]
    memory.write(store, a.tobytes(), a_at)
    memory.write(store, packed_b, b_at)
    memory.write(store, bytes([128]), za_at)
    for at_, value in ((as_at, 0.02), (bs_at, 0.005), (ys_at, 0.2)):
        memory.write(store, np.float32(value).tobytes(), at_)
    memory.write(store, bytes([128]), yz_at)
    repeat = inst.exports(store)["repeat"]
    return InProcess(label, lambda: repeat(store, calls))


def _ort_contestant(a, b):
    m, k = a.shape
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b", "za"], ["c"])], "mmi",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [m, k])],
                              [helper.make_tensor_value_info("c", TensorProto.INT32, None)],
                              [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.uint8(128), "za")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return InProcess("ort-matmulinteger", lambda: session.run(None, {"a": a}))


def bench_shape(shape, rounds: int) -> dict[str, float]:
    m, n, k = shape
    rng = np.random.default_rng(0)
    a8 = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b8 = rng.integers(-128, 128, (k, n)).astype(np.int8)
    b7 = rng.integers(-64, 64, (k, n)).astype(np.int8)   # reduce-range weights: the relaxed kernel
    af, bf = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    ops = 2.0 * m * n * k
    calls = max(1, int(-(-20e6 // ops)))   # a run is `calls` products from a loop inside the module
    contestants = [_float_contestant("f32-relaxed", af, bf, SIMD_FMA, calls),
                   _float_contestant("f32-simd", af, bf, SIMD, calls),
                   integer_contestant("int8-int32out", a8, b8, False, calls),
                   integer_contestant("int8-requant", a8, b8, True, calls),
                   integer_contestant("int8-dequant-bias", a8, b8, False, calls, dequantize=True),
                   integer_contestant("int8-relaxed-int32out", a8, b7, False, calls, relaxed=True)]
    timings = interleave(contestants + [_ort_contestant(a8, b8)], rounds, repeats_for(calls * ops / 20e9), warmup=2)
    return {name: ops * (1 if name.startswith("ort") else calls) / t.median / 1e9 for name, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", choices=("default", "minilm"), default="default")
    args = parser.parse_args()
    for shape in MINILM_SHAPES if args.shapes == "minilm" else SHAPES:
        gops = bench_shape(shape, args.rounds)
        print(f"{'x'.join(map(str, shape)):>14}: " + ", ".join(f"{k} {v:.1f}" for k, v in gops.items()) + " GOPS",
              flush=True)


if __name__ == "__main__":
    main()
