"""The WebAssembly integer GEMM (MatMulInteger, QLinearMatMul with a constant B): bit-exact against
numpy's int64 products and against onnxruntime, through the kernel alone and through compiled models."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh
from wasm_cases import make_model, run_onnxruntime, run_wasm

from backends.wasm.compile import compile_graph
from backends.wasm.kernels.int8_gemm import (IntegerGemmOffsets, pack_b, render_integer_gemm, scratch_bytes,
                                             uses_relaxed_dot)
from backends.wasm.kernels.standalone import instantiate
from backends.wasm.options import parse_options
from ir.loops.contraction import IntegerGemmSpec, RequantizeSpec
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline

ONNX_TYPE = {np.uint8: T.UINT8, np.int8: T.INT8}
# (m, n, k): tile edges in every direction (4 rows, 8 columns, 8 k per packing step), K = 1, GEMV
SHAPES = [(1, 1, 1), (4, 8, 8), (5, 9, 3), (3, 17, 33), (9, 23, 17), (1, 40, 1), (13, 3, 100), (16, 64, 384),
          (1, 96, 257), (8, 16, 2), (2, 7, 9)]


def _ints(rng, dtype, shape):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _run_kernel(spec: IntegerGemmSpec, a, b_folded, a_zero, scales=None, out_zero=None, relaxed=False):
    """Lay the operands out one after another (past 0, so that an offset bug shows), run the kernel
    once and read C back: int32, or the requantised 8-bit output."""
    q = spec.requantize
    spec = replace(spec, b_column_span=int((b_folded.max(0) - b_folded.min(0)).max()))
    packed_a, tile, scale_bytes = scratch_bytes(spec, relaxed)
    packed_b = pack_b(b_folded, relaxed).tobytes()
    out_dtype = np.int32 if q is None else (np.int8 if q.signed_output else np.uint8)
    c_bytes = spec.m * spec.n * np.dtype(out_dtype).itemsize
    a_scale, b_scale, out_scale = scales if scales is not None else (None, None, None)
    blobs = {"a": a.tobytes(), "b": packed_b, "c": None, "packed_a": packed_a, "tile": tile, "scales": scale_bytes,
             "a_zero": np.asarray(a_zero, a.dtype).tobytes(),
             "a_scale": None if a_scale is None else np.float32(a_scale).tobytes(),
             "b_scale": None if b_scale is None else np.asarray(b_scale, np.float32).tobytes(),
             "out_scale": None if out_scale is None else np.float32(out_scale).tobytes(),
             "out_zero": None if out_zero is None else np.asarray(out_zero, out_dtype).tobytes()}
    sizes = {"c": c_bytes}
    at, end = {}, 64
    for key, blob in blobs.items():
        size = sizes.get(key, len(blob) if isinstance(blob, bytes) else blob)
        if size is None or (key in ("scales",) and not size):
            at[key] = None
            continue
        at[key], end = end, end + size + 16
    offsets = IntegerGemmOffsets(at["a"], at["b"], at["c"], at["packed_a"], at["tile"], scales=at["scales"],
                                 a_zero=at["a_zero"] if spec.a_zero else None, a_scale=at["a_scale"],
                                 b_scale=at["b_scale"], out_scale=at["out_scale"], out_zero=at["out_zero"])
    features = {"simd", "relaxed-simd"} if relaxed else {"simd"}
    store, instance = instantiate(render_integer_gemm(spec, offsets, relaxed=relaxed), end, features)
    memory = instance.exports(store)["memory"]
    for key, blob in blobs.items():
        if isinstance(blob, bytes) and at[key] is not None:
            memory.write(store, blob, at[key])
    memory.write(store, b"\x5a" * c_bytes, at["c"])   # every element must be written
    instance.exports(store)["igemm"](store)
    raw = bytes(memory.read(store, at["c"], at["c"] + c_bytes))
    return np.frombuffer(raw, out_dtype).reshape(spec.m, spec.n)


def _mid_range(rng, dtype):
    """A zero point near the middle of the type's range, so that results spread on both sides."""
    info = np.iinfo(dtype)
    return np.asarray((int(info.min) + int(info.max) + 1) // 2 + rng.integers(-20, 21), dtype)


def _requantized(acc, a_scale, b_scale, out_scale, out_zero, dtype):
    """The loop nest's requantisation in numpy float32: (a_scale * b_scale) / out_scale, then
    round half to even, the zero point, saturation."""
    scale = (np.float32(a_scale) * np.asarray(b_scale, np.float32)) / np.float32(out_scale)
    q = np.rint(acc.astype(np.float32) * scale)
    if out_zero is not None:
        q = q + np.float32(out_zero)
    info = np.iinfo(dtype)
    return np.clip(q, info.min, info.max).astype(dtype)


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("a_dtype, b_dtype", [(np.uint8, np.int8), (np.int8, np.uint8), (np.uint8, np.uint8)])
def test_kernel_int32_sums_equal_numpy(m, n, k, a_dtype, b_dtype):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a, b = _ints(rng, a_dtype, (m, k)), _ints(rng, b_dtype, (k, n))
    a_zero, b_zero = _ints(rng, a_dtype, ()), _ints(rng, b_dtype, (n,))   # per-column zero point
    folded = b.astype(np.int32) - b_zero.astype(np.int32)
    spec = IntegerGemmSpec(m, n, k, a_signed=a_dtype == np.int8)
    got = _run_kernel(spec, a, folded, a_zero)
    want = (a.astype(np.int64) - int(a_zero)) @ folded.astype(np.int64)
    np.testing.assert_array_equal(got, want.astype(np.int32))


def _seven_bit_columns(rng, dtype, k, n):
    """8-bit B whose every column spans at most 127 values (as reduce-range quantisers make them)."""
    info = np.iinfo(dtype)
    low = rng.integers(info.min, info.max - 126, n)
    return (low + rng.integers(0, 128, (k, n))).astype(dtype)


@pytest.mark.parametrize("m, n, k", SHAPES + [(6, 20, 35), (4, 8, 16), (3, 8, 15)])
@pytest.mark.parametrize("a_dtype, b_dtype", [(np.uint8, np.int8), (np.int8, np.uint8), (np.uint8, np.uint8)])
def test_relaxed_kernel_int32_sums_equal_numpy(m, n, k, a_dtype, b_dtype):
    rng = np.random.default_rng(m * 1000 + n * 10 + k + 1)
    a, b = _ints(rng, a_dtype, (m, k)), _seven_bit_columns(rng, b_dtype, k, n)
    a_zero, b_zero = _ints(rng, a_dtype, ()), _ints(rng, b_dtype, (n,))
    folded = b.astype(np.int32) - b_zero.astype(np.int32)
    spec = IntegerGemmSpec(m, n, k, a_signed=a_dtype == np.int8)
    got = _run_kernel(spec, a, folded, a_zero, relaxed=True)
    want = (a.astype(np.int64) - int(a_zero)) @ folded.astype(np.int64)
    np.testing.assert_array_equal(got, want.astype(np.int32))


def test_the_relaxed_dot_product_is_used_only_where_it_is_exact():
    spec = IntegerGemmSpec(4, 8, 16, b_column_span=127)
    assert uses_relaxed_dot(spec, {"simd", "relaxed-simd"})
    assert not uses_relaxed_dot(spec, {"simd"})
    assert not uses_relaxed_dot(replace(spec, b_column_span=128), {"simd", "relaxed-simd"})
    with pytest.raises(ValueError, match="7 bits"):
        pack_b(np.array([[0], [128]]), relaxed=True)


def test_kernel_sums_wrap_as_int32_like_the_loop_nest():
    """K large enough that the extreme products overflow int32: both wrap modulo 2^32."""
    m, n, k = 2, 8, 70000
    a = np.full((m, k), 255, np.uint8)
    folded = np.full((k, n), -255, np.int32)
    got = _run_kernel(IntegerGemmSpec(m, n, k), a, folded, np.uint8(0))
    want = ((a.astype(np.int64) @ folded.astype(np.int64)) + 2**31) % 2**32 - 2**31
    np.testing.assert_array_equal(got, want.astype(np.int32))
    assert (want != a.astype(np.int64) @ folded.astype(np.int64)).all()


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("out_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("relaxed", [False, True])
def test_kernel_requantisation_equals_the_loop_nests_float32_math(m, n, k, per_column, out_dtype, relaxed):
    rng = np.random.default_rng(m * 7 + n * 3 + k)
    a = _ints(rng, np.uint8, (m, k))
    b = rng.integers(-64, 64, (k, n)).astype(np.int8) if relaxed else _ints(rng, np.int8, (k, n))
    a_zero = np.uint8(rng.integers(0, 256))
    folded = b.astype(np.int32)
    a_scale, out_scale = np.float32(0.02), np.float32(rng.uniform(0.5, 2.0) * 0.01 * k ** 0.5)
    b_scale = rng.uniform(0.002, 0.01, n if per_column else ()).astype(np.float32)
    out_zero = _mid_range(rng, out_dtype)
    spec = IntegerGemmSpec(m, n, k, requantize=RequantizeSpec(per_column, out_dtype == np.int8))
    got = _run_kernel(spec, a, folded, a_zero, (a_scale, b_scale, out_scale), out_zero, relaxed)
    acc = ((a.astype(np.int64) - int(a_zero)) @ folded).astype(np.int32)
    want = _requantized(acc, a_scale, b_scale, out_scale, out_zero, out_dtype)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > min(3, m * n // 2)   # the scales put the results inside the range


def test_kernel_requantisation_rounds_half_to_even_and_saturates():
    """Sums that land exactly on .5 after scaling, and sums far outside the output range."""
    m, n, k = 4, 8, 1
    a = np.array([[1], [3], [5], [-7]], np.int8)
    folded = np.array([[1, -1, 101, -101, 1000 // 8, 3, -3, 0]], np.int32)
    spec = IntegerGemmSpec(m, n, k, a_signed=True, requantize=RequantizeSpec(False, False))
    got = _run_kernel(spec, a, folded, np.int8(0), (np.float32(0.5), np.float32(1.0), np.float32(1.0)), np.uint8(10))
    acc = a.astype(np.int32) @ folded
    want = _requantized(acc, 0.5, 1.0, 1.0, 10, np.uint8)
    np.testing.assert_array_equal(got, want)
    assert got[1, 0] == 12 and got[0, 0] == 10    # 1.5 -> 2, 0.5 -> 0
    assert got[0, 3] == 0 and got[2, 2] == 255


# -- through compiled models, against onnxruntime ----------------------------------------------

def _matmul_integer_model(rng, a_shape, n, a_dtype, b_dtype, per_column, with_zero=True, seven_bit=False):
    k = a_shape[-1]
    b = _seven_bit_columns(rng, b_dtype, k, n) if seven_bit else _ints(rng, b_dtype, (k, n))
    inputs = [helper.make_tensor_value_info("a", ONNX_TYPE[a_dtype], a_shape)]
    feeds = {"a": _ints(rng, a_dtype, a_shape)}
    initializers = [nh.from_array(b, "b")]
    names = ["a", "b"]
    if with_zero:
        inputs.append(helper.make_tensor_value_info("a_zero", ONNX_TYPE[a_dtype], ()))
        feeds["a_zero"] = _ints(rng, a_dtype, ())
        initializers.append(nh.from_array(_ints(rng, b_dtype, (n,) if per_column else ()), "b_zero"))
        names += ["a_zero", "b_zero"]
    node = helper.make_node("MatMulInteger", names, ["y"])
    model = make_model([node], inputs, [helper.make_tensor_value_info("y", T.INT32, None)], initializers, opset=13)
    return model, feeds


def _qlinear_matmul_model(rng, a_shape, n, a_dtype, b_dtype, out_dtype, per_column, seven_bit=False):
    k = a_shape[-1]
    per = (n,) if per_column else ()
    info = np.iinfo(b_dtype)
    middle = (int(info.min) + int(info.max) + 1) // 2
    b = (rng.integers(middle - 64, middle + 64, (k, n)).astype(b_dtype) if seven_bit else _ints(rng, b_dtype, (k, n)))
    initializers = [nh.from_array(b, "b"),
                    nh.from_array(rng.uniform(0.002, 0.01, per).astype(np.float32), "b_scale"),
                    nh.from_array(_mid_range(rng, b_dtype) + np.zeros(per, b_dtype), "b_zero"),
                    nh.from_array(np.float32(0.01 * k ** 0.5), "y_scale"),
                    nh.from_array(_mid_range(rng, out_dtype), "y_zero")]
    inputs = [helper.make_tensor_value_info("a", ONNX_TYPE[a_dtype], a_shape),
              helper.make_tensor_value_info("a_scale", T.FLOAT, ()),
              helper.make_tensor_value_info("a_zero", ONNX_TYPE[a_dtype], ())]
    feeds = {"a": _ints(rng, a_dtype, a_shape), "a_scale": np.array(rng.uniform(0.01, 0.03), np.float32),
             "a_zero": _mid_range(rng, a_dtype)}
    node = helper.make_node("QLinearMatMul", ["a", "a_scale", "a_zero", "b", "b_scale", "b_zero", "y_scale", "y_zero"],
                            ["y"])
    model = make_model([node], inputs, [helper.make_tensor_value_info("y", ONNX_TYPE[out_dtype], None)],
                       initializers, opset=13)
    return model, feeds


def _wat(model, features):
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return compile_graph(graph, parse_options(None, features, "2")).wat


FEATURES = ["simd", "simd,relaxed-simd"]
MODEL_CASES = [((16, 384), 40), ((2, 3, 33), 17), ((1, 1), 9), ((77,), 24), ((5, 100), 1), ((7, 9), 64)]


@pytest.mark.parametrize("a_shape, n", MODEL_CASES)
@pytest.mark.parametrize("a_dtype, b_dtype, per_column", [(np.uint8, np.int8, False), (np.uint8, np.uint8, True),
                                                          (np.int8, np.int8, True)])
def test_matmul_integer_equals_onnxruntime(a_shape, n, a_dtype, b_dtype, per_column):
    rng = np.random.default_rng(sum(a_shape) * 31 + n)
    model, feeds = _matmul_integer_model(rng, a_shape, n, a_dtype, b_dtype, per_column)
    want = run_onnxruntime(model, feeds)["y"]
    for features in FEATURES:
        got = run_wasm(model, feeds, features, "2")["y"]
        assert got.dtype == np.int32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want, err_msg=features)


@pytest.mark.parametrize("a_shape, n", MODEL_CASES)
@pytest.mark.parametrize("a_dtype, b_dtype, out_dtype, per_column", [
    (np.uint8, np.int8, np.uint8, False), (np.uint8, np.int8, np.uint8, True), (np.int8, np.int8, np.int8, True),
    (np.uint8, np.uint8, np.uint8, False)])
def test_qlinear_matmul_equals_onnxruntime(a_shape, n, a_dtype, b_dtype, out_dtype, per_column):
    rng = np.random.default_rng(sum(a_shape) * 17 + n)
    model, feeds = _qlinear_matmul_model(rng, a_shape, n, a_dtype, b_dtype, out_dtype, per_column)
    want = run_onnxruntime(model, feeds)["y"]
    assert len(np.unique(want)) > min(2, want.size - 1)
    for features in FEATURES:
        got = run_wasm(model, feeds, features, "2")["y"]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want, err_msg=features)


@pytest.mark.parametrize("a_shape, n", MODEL_CASES)
@pytest.mark.parametrize("a_dtype, b_dtype", [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8)])
def test_seven_bit_weights_run_on_the_relaxed_dot_product_and_equal_onnxruntime(a_shape, n, a_dtype, b_dtype):
    """Weights of a reduce-range quantiser: with relaxed SIMD the 8-bit dot product, bit-exact."""
    rng = np.random.default_rng(sum(a_shape) * 13 + n)
    for model, feeds in (_matmul_integer_model(rng, a_shape, n, a_dtype, b_dtype, True, seven_bit=True),
                         _qlinear_matmul_model(rng, a_shape, n, a_dtype, b_dtype, a_dtype, True, seven_bit=True)):
        want = run_onnxruntime(model, feeds)["y"]
        got = run_wasm(model, feeds, "simd,relaxed-simd", "2")["y"]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    wat = _wat(model, "simd,relaxed-simd")
    assert "i16x8.relaxed_dot_i8x16_i7x16_s" in wat and "i32x4.dot_i16x8_s" not in wat


def test_full_range_weights_keep_the_16_bit_kernel_under_relaxed_simd():
    rng = np.random.default_rng(8)
    model, _ = _matmul_integer_model(rng, (16, 64), 32, np.uint8, np.int8, False)
    wat = _wat(model, "simd,relaxed-simd")
    assert "i32x4.dot_i16x8_s" in wat and "relaxed_dot" not in wat


def test_the_kernel_and_the_loop_nest_give_the_same_bits():
    """The loop nest (no SIMD, or opt-level 0) is the reference the kernel must equal."""
    rng = np.random.default_rng(5)
    model, feeds = _qlinear_matmul_model(rng, (3, 19, 45), 27, np.uint8, np.int8, np.uint8, True)
    kernel = run_wasm(model, feeds, "simd", "2")["y"]
    for features, level in (("", "2"), ("simd", "0")):
        np.testing.assert_array_equal(kernel, run_wasm(model, feeds, features, level)["y"])


@pytest.mark.parametrize("op", ["MatMulInteger", "QLinearMatMul"])
def test_a_constant_weight_uses_the_dot_product_kernel(op):
    rng = np.random.default_rng(2)
    model, _ = (_matmul_integer_model(rng, (16, 64), 32, np.uint8, np.int8, False) if op == "MatMulInteger"
                else _qlinear_matmul_model(rng, (16, 64), 32, np.uint8, np.int8, np.uint8, False))
    assert "i32x4.dot_i16x8_s" in _wat(model, "simd")
    assert "i32x4.dot_i16x8_s" not in _wat(model, "")


def test_a_weight_computed_at_run_time_is_packed_at_run_time():
    """B an input (tests/test_int8_attention.py has the batched forms)."""
    rng = np.random.default_rng(3)
    a, b = _ints(rng, np.uint8, (6, 10)), _ints(rng, np.int8, (10, 12))
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    model = make_model([node], [helper.make_tensor_value_info("a", T.UINT8, a.shape),
                                helper.make_tensor_value_info("b", T.INT8, b.shape)],
                       [helper.make_tensor_value_info("y", T.INT32, None)], opset=13)
    feeds = {"a": a, "b": b}
    assert "B packed at run time" in _wat(model, "simd")
    np.testing.assert_array_equal(run_wasm(model, feeds, "simd", "2")["y"], run_onnxruntime(model, feeds)["y"])


def test_without_zero_points_the_product_is_plain():
    rng = np.random.default_rng(4)
    model, feeds = _matmul_integer_model(rng, (5, 21), 11, np.uint8, np.int8, False, with_zero=False)
    want = feeds["a"].astype(np.int64) @ nh.to_array(model.graph.initializer[0]).astype(np.int64)
    np.testing.assert_array_equal(run_wasm(model, feeds, "simd", "2")["y"], want)
