"""A CU's large contractions on several threads over one shared memory (`--wasm-features threads`,
backends/wasm/kernel_parts.py, kernel_threads.py): every way a contraction is cut (GEMM rows, a
batched product's batches, a GEMV's columns, a large Conv's row chunks, a small Conv's output
channels, a grouped Conv's groups, a 1x1 Conv) gives the same bits on 1, 2 and 3 threads, the bits of the build that does not
split it, and onnxruntime's values; the trace says which CUs split and on how many threads; a worker
that traps mid-kernel fails the request in one line naming the CU and leaves the model usable; the
CLI runs such a build and refuses bad options in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import assert_one_line_error, run_cli
from nbits_cases import packed_weight
from onnx import TensorProto, helper, numpy_helper
from testdata import run_onnxruntime

import cortex
from cortex.runtime.trace import validate_trace
from ir.errors import CortexError

THREADS = "simd,relaxed-simd,threads"
PLAIN = "simd,relaxed-simd"


def _model(nodes, inputs, output, inits) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _weight(rng, name, *shape) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 2 else shape[0]
    return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)


def matmul_rows(rng):
    """MatMul + bias + Relu, 96 rows: parts of 4-row tiles."""
    return _model([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
                   helper.make_node("Relu", ["a"], ["y"])],
                  [("x", [96, 256])], ("y", [96, 320]), [_weight(rng, "w", 256, 320), _weight(rng, "b", 320)])


def attention_batches(rng):
    """Q @ K^T over 8 heads: an activation B, parts of heads, each packing its own."""
    return _model([helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
                   helper.make_node("MatMul", ["q", "kt"], ["y"])],
                  [("q", [8, 128, 64]), ("k", [8, 128, 64])], ("y", [8, 128, 128]), [])


def gemv_columns(rng):
    """One row against a 1024 x 3000 weight: parts of 16-column panels, the last one ragged."""
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [1, 1024])], ("y", [1, 3000]),
                  [_weight(rng, "w", 1024, 3000)])


def nbits_columns(rng, level: int):
    """A decode step's 4-bit product (MatMulNBits, one row, zero points) at accuracy level `level`:
    parts of 16-column panels of its blocks, each part quantizing its own copy of A."""
    k, n, block = 2048, 2080, 32
    weight = packed_weight(rng, 4, k, n, block, True)
    order = ["x", "w_b", "w_s", "w_zp"]
    node = helper.make_node("MatMulNBits", order, ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=level)
    inits = [numpy_helper.from_array(array, f"w_{key}") for key, array in weight.items()]
    model = _model([node], [("x", [1, k])], ("y", [1, n]), inits)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def conv_implicit(rng):
    """A 3x3 Conv to 32 channels (the implicit GEMM over pixels), with bias and Relu."""
    return _model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                   helper.make_node("Relu", ["c"], ["y"])],
                  [("x", [1, 32, 56, 56])], ("y", [1, 32, 56, 56]), [_weight(rng, "w", 32, 32, 3, 3),
                                                                     _weight(rng, "b", 32)])


def conv_chunks(rng):
    """A 3x3 Conv to 128 channels on a large image (im2col in row chunks), with bias and Relu."""
    return _model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                   helper.make_node("Relu", ["c"], ["y"])],
                  [("x", [1, 32, 96, 96])], ("y", [1, 128, 96, 96]), [_weight(rng, "w", 128, 32, 3, 3),
                                                                      _weight(rng, "b", 128)])


def conv_channels(rng):
    """A 3x3 stride-2 Conv on a small image (output channels), then a 1x1 Conv with a residual Add."""
    return _model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
                   helper.make_node("Conv", ["c", "w1"], ["p"]), helper.make_node("Add", ["p", "c"], ["y"])],
                  [("x", [1, 64, 28, 28])], ("y", [1, 128, 14, 14]),
                  [_weight(rng, "w", 128, 64, 3, 3), _weight(rng, "b", 128), _weight(rng, "w1", 128, 128, 1, 1)])


def conv_groups(rng):
    """A grouped 3x3 Conv (alexnet's groups of 2, here 4 groups of 48 channels), with bias and Relu:
    parts of whole groups over one im2col."""
    return _model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], group=4),
                   helper.make_node("Relu", ["c"], ["y"])],
                  [("x", [1, 192, 13, 13])], ("y", [1, 192, 13, 13]), [_weight(rng, "w", 192, 48, 3, 3),
                                                                       _weight(rng, "b", 192)])


def normalised_rows(rng):
    """LayerNormalization then Softmax over 512 rows: loop-nest kernels cut along their rows."""
    return _model([helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1, epsilon=1e-5),
                   helper.make_node("Softmax", ["n"], ["y"], axis=-1)],
                  [("x", [512, 768])], ("y", [512, 768]),
                  [numpy_helper.from_array(rng.standard_normal(768).astype(np.float32), "g"),
                   numpy_helper.from_array(rng.standard_normal(768).astype(np.float32), "b")])


def elementwise_flat(rng):
    """SiLU over 300,007 elements: one vectorised loop cut at multiples of 16, a scalar tail."""
    return _model([helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
                  [("x", [300007])], ("y", [300007]), [])


CASES = {"normalised-rows": normalised_rows, "elementwise-flat": elementwise_flat, "nbits-level4": lambda rng: nbits_columns(rng, 4), "nbits-level0": lambda rng: nbits_columns(rng, 0),
         "matmul-rows": matmul_rows, "attention-batches": attention_batches, "gemv-columns": gemv_columns,
         "conv-implicit": conv_implicit, "conv-chunks": conv_chunks, "conv-channels": conv_channels,
         "conv-groups": conv_groups}


# decompose splits ops with more parameters than --max-cu-size (1M) into CUs of their own: the GEMV
# case is one CU only above it.
BUILD_FLAGS = {"gemv-columns": ("--max-cu-size", "4000000"), "nbits-level4": ("--max-cu-size", "100000000"),
               "nbits-level0": ("--max-cu-size", "100000000")}


def _build(tmp_path: Path, name: str, features: str, *extra) -> Path:
    model = tmp_path / f"{name}.onnx"
    if not model.exists():
        onnx.save(CASES[name](np.random.default_rng(7)), model)
    out = tmp_path / f"{name}-{features.replace(',', '-')}{'-'.join(extra)}"
    code, _, err = run_cli(["build", model, "--output", out, "--wasm-features", features,
                            *BUILD_FLAGS.get(name, ()), *extra])
    assert code == 0, err
    return out / "dag.json"


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


def _run(dag: Path, feeds: dict, threads: int) -> tuple[np.ndarray, dict]:
    model = cortex.load(dag, threads=threads, policy="strict")
    try:
        (y,) = model.run(feeds).values()
        return np.array(y), model.last_trace
    finally:
        model.close()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_split_contraction_gives_the_same_bits_on_1_2_and_3_threads(tmp_path, name):
    threaded, plain = _build(tmp_path, name, THREADS), _build(tmp_path, name, PLAIN)
    model = onnx.load(tmp_path / f"{name}.onnx")
    feeds = _feeds(model)
    (expected,) = run_onnxruntime(model, feeds).values()
    one, trace = _run(threaded, feeds, 1)
    assert trace["threads"]["split_cus"], "no contraction was split"
    for threads in (2, 3):
        got, trace = _run(threaded, feeds, threads)
        assert trace["threads"]["kernel_threads"] == threads
        np.testing.assert_array_equal(got, one)
    np.testing.assert_array_equal(_run(plain, feeds, 1)[0], one)
    np.testing.assert_allclose(one, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    validate_trace(trace)


def test_parts_follow_kernel_parts_and_small_work_stays_whole(tmp_path):
    dag = _build(tmp_path, "matmul-rows", THREADS, "--wasm-kernel-parts", "3")
    record = cortex.load(dag).dag["cus"][0]["artifacts"]["wasm"]
    assert record["options"]["kernel_parts"] == 3 and record["memory"]["threads"]["parts"] == 3
    small = tmp_path / "small.onnx"
    onnx.save(_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [4, 16])], ("y", [4, 16]),
                     [_weight(np.random.default_rng(1), "w", 16, 16)]), small)
    code, _, err = run_cli(["build", small, "--output", tmp_path / "small", "--wasm-features", THREADS])
    assert code == 0, err
    assert "threads" not in cortex.load(tmp_path / "small" / "dag.json").dag["cus"][0]["artifacts"]["wasm"]["memory"]


def test_a_worker_trapping_mid_kernel_fails_the_request_in_one_line_and_the_model_goes_on(tmp_path):
    dag = _build(tmp_path, "conv-chunks", THREADS)
    feeds = _feeds(onnx.load(tmp_path / "conv-chunks.onnx"))
    expected, _ = _run(dag, feeds, 1)
    model = cortex.load(dag, threads=2, policy="strict")
    try:
        model.run(feeds)
        device = model._loaded_scheduler().devices["wasm"]
        (cu_id, workers), = device.workers.items()
        failures = 0
        for _ in range(20):     # a worker takes a part only when it claims one first: bounded retries
            device.workers[cu_id].inject_fault()
            try:
                model.run(feeds)
            except CortexError as e:
                message = str(e)
                assert "\n" not in message and cu_id in message and "kernel thread 1 trapped" in message, message
                failures += 1
                break
        assert failures == 1, "no worker ever took the faulty part"
        (y,) = model.run(feeds).values()     # a fresh memory and fresh workers, no fault armed
        np.testing.assert_array_equal(np.array(y), expected)
        assert model.last_trace["sandbox_stats"]["traps"] >= 1
    finally:
        model.close()


def test_the_cli_runs_a_threads_build_and_refuses_bad_options(tmp_path):
    dag = _build(tmp_path, "matmul-rows", THREADS)
    feeds = _feeds(onnx.load(tmp_path / "matmul-rows.onnx"))
    np.savez(tmp_path / "in.npz", **feeds)
    code, _, err = run_cli(["run", dag, "--input", tmp_path / "in.npz", "--output", tmp_path / "out.npz",
                            "--threads", "2"])
    assert code == 0, err
    code, _, err = run_cli(["build", tmp_path / "matmul-rows.onnx", "--output", tmp_path / "bad",
                            "--wasm-features", THREADS, "--wasm-kernel-parts", "0"])
    assert_one_line_error(code, err, "--wasm-kernel-parts")
    assert not (tmp_path / "bad").exists()


def matmul_chain(rng):
    """Two MatMuls, each a CU of its own at --max-cu-depth 1: one evicts the other under a budget."""
    return _model([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                   helper.make_node("MatMul", ["r", "w2"], ["y"])],
                  [("x", [96, 256])], ("y", [96, 256]), [_weight(rng, "w1", 256, 512), _weight(rng, "w2", 512, 256)])


CASES["matmul-chain"] = matmul_chain
BUILD_FLAGS["matmul-chain"] = ("--max-cu-depth", "1")


def test_under_a_memory_budget_evicted_split_cus_come_back_with_their_threads(tmp_path):
    dag = _build(tmp_path, "matmul-chain", THREADS)
    feeds = _feeds(onnx.load(tmp_path / "matmul-chain.onnx"))
    expected, _ = _run(dag, feeds, 1)
    whole = cortex.load(dag)
    footprints = [whole._loaded_scheduler().devices["wasm"].footprint(cu) for cu in whole.dag["cus"]]
    whole.close()
    assert len(footprints) >= 2
    model = cortex.load(dag, threads=2, policy="strict", memory_budget_mb=max(footprints) * 1.2 / (1 << 20))
    try:
        for _ in range(3):
            (y,) = model.run(feeds).values()
            np.testing.assert_array_equal(np.array(y), expected)
        assert model.last_trace["memory"]["evictions"] >= 1
        assert model.last_trace["threads"]["kernel_threads"] == 2
    finally:
        model.close()
