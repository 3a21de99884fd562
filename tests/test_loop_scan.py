"""Loop and Scan: a loop of the loop-nest IR around the body (trip counts above the unrolling
limit), or copies of the body (at most `MAX_TRIPS` iterations), matched against onnxruntime end to
end through the installed CLI on wasm, and on cuda-sim for a few."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from backends.cuda import toolchain as cuda_toolchain
from cli_helpers import assert_one_line_error, run_cli
from ir.onnx_import import import_model
from passes import optimize_pipeline, run_pipeline
from passes.unroll_loops import MAX_TRIPS
from wasm_cases import make_model, run_onnxruntime

RTOL, ATOL = 1e-4, 1e-5
LONG = MAX_TRIPS + 9          # above the unrolling limit: compiled as a loop in the IR
needs_nvcc = pytest.mark.skipif(cuda_toolchain.find_nvcc() is None, reason="nvcc not installed")


def _info(name, dtype=T.FLOAT, shape=None):
    return h.make_tensor_value_info(name, dtype, shape)


def _const(name, value, dtype=T.INT64):
    value = np.asarray(value)
    return h.make_tensor(name, dtype, list(value.shape), value.reshape(-1).tolist())


def build(model: onnx.ModelProto, tmp_path, target: str = "wasm"):
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    cus, dag = tmp_path / "cus", tmp_path / "dag.json"
    for argv in (["decompose", "--model-path", path, "--output-dir", cus],
                 ["build-dag", "--cu-dir", cus, "--output", dag],
                 [f"compile-{target}", "--cu-dir", cus, "--dag", dag, "--output", tmp_path / f"{target}-bin"]):
        code, _, err = run_cli(argv)
        if code != 0:
            return code, err
    return 0, dag


def run_built(dag, feeds: dict, tmp_path, device: str = "wasm") -> dict:
    argv = ["run", dag, "--device", device, "--output", tmp_path / "out.npz"]
    for name, array in feeds.items():
        np.save(tmp_path / f"{name}.npy", array)
        argv += ["--input", f"{name}={tmp_path / f'{name}.npy'}"]
    code, _, err = run_cli(argv)
    assert code == 0, err
    with np.load(tmp_path / "out.npz") as got:
        return dict(got)


def assert_matches_onnxruntime(model, feeds, tmp_path, device="wasm"):
    code, dag = build(model, tmp_path, "cuda" if device == "cuda-sim" else device)
    assert code == 0, dag
    got = run_built(dag, feeds, tmp_path, device)
    expected = run_onnxruntime(model, feeds)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape and got[name].dtype == want.dtype, name
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
    return got


def ops_after_optimizing(model) -> list[str]:
    graph, _ = run_pipeline(import_model(model), optimize_pipeline(require_static=True))
    return [n.op_type for n in graph.nodes]


# -- models ----------------------------------------------------------------------------------------

def counted_loop(trips: int, opset: int = 17) -> onnx.ModelProto:
    """s <- tanh(s * w + x + i / 8) for `trips` iterations, each row s; w and x are read from the
    enclosing graph, the iteration number is used as data."""
    body = h.make_graph([
        h.make_node("Cast", ["i"], ["i_f"], to=T.FLOAT),
        h.make_node("Div", ["i_f", "eight"], ["i_scaled"]),
        h.make_node("Mul", ["s_in", "w"], ["sw"]),
        h.make_node("Add", ["sw", "x"], ["swx"]),
        h.make_node("Add", ["swx", "i_scaled"], ["pre"]),
        h.make_node("Tanh", ["pre"], ["s_out"]),
        h.make_node("Identity", ["cond_in"], ["cond_out"]),
        h.make_node("Identity", ["s_out"], ["row"]),
    ], "body", [_info("i", T.INT64, []), _info("cond_in", T.BOOL, []), _info("s_in")],
        [_info("cond_out", T.BOOL, []), _info("s_out"), _info("row")], [_const("eight", 8.0, T.FLOAT)])
    return make_model([h.make_node("Loop", ["M", "", "s0"], ["s", "rows"], body=body, name="counted")],
                      [_info("s0", shape=[2, 3]), _info("x", shape=[2, 3]), _info("w", shape=[3])],
                      [_info("s", shape=[2, 3]), _info("rows", shape=[trips, 2, 3])],
                      [_const("M", trips)], opset=opset)


def early_exit_loop() -> onnx.ModelProto:
    """Doubles s (and counts the iterations in n) while sum(s) < 1000, at most 40 times: the body
    computes the condition, so the loop stops early."""
    body = h.make_graph([
        h.make_node("Mul", ["s_in", "two"], ["s_out"]),
        h.make_node("Add", ["n_in", "one"], ["n_out"]),
        h.make_node("ReduceSum", ["s_out"], ["total"], keepdims=0),
        h.make_node("Less", ["total", "limit"], ["cond_out"]),
    ], "body", [_info("i", T.INT64, []), _info("cond_in", T.BOOL, []), _info("s_in"), _info("n_in", T.INT64, [])],
        [_info("cond_out", T.BOOL, []), _info("s_out"), _info("n_out", T.INT64, [])],
        [_const("two", 2.0, T.FLOAT), _const("one", 1), _const("limit", 1000.0, T.FLOAT)])
    return make_model([h.make_node("Loop", ["M", "go", "s0", "n0"], ["s", "n"], body=body, name="doubling")],
                      [_info("s0", shape=[4])], [_info("s", shape=[4]), _info("n", T.INT64, [])],
                      [_const("M", 40), _const("go", True, T.BOOL), _const("n0", 0)])


def nested_loop() -> onnx.ModelProto:
    """An outer loop whose body runs an inner loop over the outer state and a graph input."""
    inner = h.make_graph([
        h.make_node("Mul", ["t_in", "decay"], ["t_scaled"]),
        h.make_node("Add", ["t_scaled", "x"], ["t_out"]),
        h.make_node("Identity", ["c"], ["c_out"]),
    ], "inner", [_info("j", T.INT64, []), _info("c", T.BOOL, []), _info("t_in")],
        [_info("c_out", T.BOOL, []), _info("t_out")])
    outer = h.make_graph([
        h.make_node("Loop", ["N", "", "s_in"], ["t_final"], body=inner, name="inner"),
        h.make_node("Sin", ["t_final"], ["s_out"]),
        h.make_node("Identity", ["cond_in"], ["cond_out"]),
        h.make_node("ReduceMax", ["s_out"], ["peak"], keepdims=1),
    ], "outer", [_info("i", T.INT64, []), _info("cond_in", T.BOOL, []), _info("s_in")],
        [_info("cond_out", T.BOOL, []), _info("s_out"), _info("peak")])
    return make_model([h.make_node("Loop", ["M", "", "s0"], ["s", "peaks"], body=outer, name="outer")],
                      [_info("s0", shape=[5]), _info("x", shape=[5])],
                      [_info("s", shape=[5]), _info("peaks", shape=[LONG, 1])],
                      [_const("M", LONG), _const("N", MAX_TRIPS + 3), _const("decay", 0.5, T.FLOAT)])


def scan_model(length: int) -> onnx.ModelProto:
    """Two states (a running sum and a running max) over two scan inputs scanned along different
    axes, one of them in reverse, and two scan outputs written along different axes, one in reverse."""
    body = h.make_graph([
        h.make_node("Mul", ["a_t", "b_t"], ["ab"]),
        h.make_node("Add", ["sum_in", "ab"], ["sum_out"]),
        h.make_node("Max", ["max_in", "a_t"], ["max_out"]),
        h.make_node("Sub", ["sum_out", "max_out"], ["gap"]),
        h.make_node("Mul", ["ab", "scale"], ["scaled"]),
    ], "body", [_info("sum_in", shape=[3]), _info("max_in", shape=[3]), _info("a_t", shape=[3]), _info("b_t", shape=[3])],
        [_info("sum_out", shape=[3]), _info("max_out", shape=[3]), _info("gap", shape=[3]), _info("scaled", shape=[3])])
    node = h.make_node("Scan", ["sum0", "max0", "a", "b"], ["sum", "max", "gaps", "scaled_rows"], body=body,
                       num_scan_inputs=2, scan_input_axes=[0, 1], scan_input_directions=[0, 1],
                       scan_output_axes=[1, 0], scan_output_directions=[0, 1], name="scan")
    return make_model([node],
                      [_info("sum0", shape=[3]), _info("max0", shape=[3]), _info("a", shape=[length, 3]),
                       _info("b", shape=[3, length]), _info("scale", shape=[3])],
                      [_info("sum", shape=[3]), _info("max", shape=[3]), _info("gaps", shape=[3, length]),
                       _info("scaled_rows", shape=[length, 3])], opset=17)


def scan_feeds(length, rng):
    return {"sum0": rng.standard_normal(3).astype(np.float32), "max0": rng.standard_normal(3).astype(np.float32),
            "a": rng.standard_normal((length, 3)).astype(np.float32),
            "b": rng.standard_normal((3, length)).astype(np.float32),
            "scale": rng.standard_normal(3).astype(np.float32)}


def loop_feeds(rng):
    return {"s0": rng.standard_normal((2, 3)).astype(np.float32), "x": rng.standard_normal((2, 3)).astype(np.float32),
            "w": rng.standard_normal(3).astype(np.float32)}


# -- wasm ------------------------------------------------------------------------------------------

def test_loop_with_constant_trip_count_and_carried_state(tmp_path):
    model = counted_loop(LONG)
    assert ops_after_optimizing(model) == ["Loop"]
    assert_matches_onnxruntime(model, loop_feeds(np.random.default_rng(0)), tmp_path)


def test_tiny_loop_unrolls_into_the_graph(tmp_path):
    model = counted_loop(4)
    assert "Loop" not in ops_after_optimizing(model)
    assert_matches_onnxruntime(model, loop_feeds(np.random.default_rng(1)), tmp_path)


def test_loop_stops_early_when_the_body_clears_its_condition(tmp_path):
    got = assert_matches_onnxruntime(early_exit_loop(), {"s0": np.array([1, 2, 3, 4], np.float32)}, tmp_path)
    assert int(got["n"]) == 7           # sum 10 * 2**7 = 1280 >= 1000: well before the 40 allowed


def test_nested_loop_reads_outer_values(tmp_path):
    rng = np.random.default_rng(2)
    assert_matches_onnxruntime(nested_loop(), {"s0": rng.standard_normal(5).astype(np.float32),
                                               "x": rng.standard_normal(5).astype(np.float32)}, tmp_path)


@pytest.mark.parametrize("length", [LONG, 3])
def test_scan_with_several_states_axes_and_directions(length, tmp_path):
    assert_matches_onnxruntime(scan_model(length), scan_feeds(length, np.random.default_rng(length)), tmp_path)


def test_loop_from_torchscript(tmp_path):
    torch = pytest.importorskip("torch")

    class Recurrence(torch.nn.Module):
        def forward(self, x, state):
            for i in range(x.size(0)):
                state = torch.tanh(x[i] @ state + 0.5 * state)
            return state

    path = tmp_path / "torch.onnx"
    # Seeded: for some draws 25 steps of this tanh map amplify a last-bit difference of tanh past
    # the tolerance, which says nothing about the loop.
    generator = torch.Generator().manual_seed(0)
    x, state = 0.5 * torch.randn(LONG, 4, generator=generator), torch.randn(4, 4, generator=generator)
    torch.onnx.export(torch.jit.script(Recurrence()), (x, state), str(path), dynamo=False,
                      input_names=["x", "state"], output_names=["y"])
    model = onnx.load(path)
    assert "Loop" in [n.op_type for n in model.graph.node]
    assert_matches_onnxruntime(model, {"x": x.numpy(), "state": state.numpy()}, tmp_path)


# -- refusals --------------------------------------------------------------------------------------

def test_a_body_that_grows_its_state_is_refused_naming_the_node(tmp_path):
    body = h.make_graph([h.make_node("Concat", ["s_in", "s_in"], ["s_out"], axis=0),
                         h.make_node("Identity", ["cond_in"], ["cond_out"])],
                        "body", [_info("i", T.INT64, []), _info("cond_in", T.BOOL, []), _info("s_in")],
                        [_info("cond_out", T.BOOL, []), _info("s_out")])
    model = make_model([h.make_node("Loop", ["M", "", "s0"], ["s"], body=body, name="growing")],
                       [_info("s0", shape=[2])], [_info("s")], [_const("M", LONG)])
    code, err = build(model, tmp_path)
    assert_one_line_error(code, err, "'growing' (Loop)", "changes the shape of loop-carried 's_in' from [2] to [4]")


def test_scan_outputs_of_a_loop_that_may_stop_early_are_refused_naming_the_node(tmp_path):
    body = h.make_graph([h.make_node("Add", ["s_in", "one"], ["s_out"]),
                         h.make_node("ReduceSum", ["s_out"], ["total"], keepdims=0),
                         h.make_node("Less", ["total", "limit"], ["cond_out"]),
                         h.make_node("Identity", ["s_out"], ["row"])],
                        "body", [_info("i", T.INT64, []), _info("cond_in", T.BOOL, []), _info("s_in")],
                        [_info("cond_out", T.BOOL, []), _info("s_out"), _info("row")],
                        [_const("one", 1.0, T.FLOAT), _const("limit", 50.0, T.FLOAT)])
    model = make_model([h.make_node("Loop", ["M", "", "s0"], ["s", "rows"], body=body, name="stopping")],
                       [_info("s0", shape=[2])], [_info("s", shape=[2]), _info("rows")], [_const("M", LONG)])
    code, err = build(model, tmp_path)
    assert_one_line_error(code, err, "'stopping' (Loop)", "depends on when the loop stops")


# -- cuda-sim --------------------------------------------------------------------------------------

@needs_nvcc
def test_loop_on_cuda_sim(tmp_path):
    assert_matches_onnxruntime(counted_loop(LONG), loop_feeds(np.random.default_rng(3)), tmp_path, "cuda-sim")


@needs_nvcc
def test_early_exit_loop_on_cuda_sim(tmp_path):
    got = assert_matches_onnxruntime(early_exit_loop(), {"s0": np.array([1, 2, 3, 4], np.float32)}, tmp_path,
                                     "cuda-sim")
    assert int(got["n"]) == 7


@needs_nvcc
def test_scan_on_cuda_sim(tmp_path):
    assert_matches_onnxruntime(scan_model(LONG), scan_feeds(LONG, np.random.default_rng(4)), tmp_path, "cuda-sim")
