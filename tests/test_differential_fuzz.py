"""Differential fuzzing: random small graphs of supported ops go through the whole pipeline
(decompose, build-dag, compile-wasm, cortex.load) at every opt level and feature set, and must
agree with onnxruntime on the same feed (rtol 1e-4, atol 1e-5; integers exactly).

A graph is a chain: each step applies one op to the value the previous step produced, drawing its
other operands (broadcast operands, weights, indices) as fresh inputs or initializers, so every
input reaches the output. Shapes come from onnx's own shape inference as the graph grows. A failing
example prints the shrunk graph in ONNX text form and the opt level and features that failed.
The default run is small and derandomized; the `slow` variants draw many more graphs.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, note, reject, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from backends.registry import target
from cortex.compile import compile_cu_dir
from backends.wasm.options import OPT_LEVELS, parse_options
from cortex.commands.decompose import decompose_model
from cortex.dag import build_dag
from cortex.runtime import load
from ir.fs import write_bytes_atomically
from passes.partition import PartitionIntoCUs

RTOL, ATOL = 1e-4, 1e-5
OPSET = 18
FEATURE_SETS = [",".join(f for f in (vector, bulk) if f) for vector in ("", "simd", "simd,relaxed-simd")
                for bulk in ("", "bulk-memory")]
ONNX_DTYPE = {np.float32: TensorProto.FLOAT, np.int32: TensorProto.INT32, np.int64: TensorProto.INT64}

DEFAULT_RUN = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                              HealthCheck.filter_too_much])
LONG_RUN = settings(DEFAULT_RUN, max_examples=150)


@dataclass
class ChainBuilder:
    """A graph under construction: the value the chain has reached, and everything feeding it."""
    dtype: type
    rng: np.random.Generator
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    feeds: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    counter: int = 0

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def random_array(self, shape, dtype=None) -> np.ndarray:
        dtype = dtype or self.dtype
        if np.dtype(dtype).kind == "f":
            return self.rng.uniform(-2.0, 2.0, size=shape).astype(dtype)
        return self.rng.integers(-5, 6, size=shape).astype(dtype)

    def add_input(self, shape, dtype=None) -> str:
        name = self.fresh("x")
        value = self.random_array(shape, dtype)
        self.inputs.append(helper.make_tensor_value_info(name, ONNX_DTYPE[value.dtype.type], list(shape)))
        self.feeds[name] = value
        self.shapes[name] = tuple(shape)
        return name

    def add_input_value(self, value: np.ndarray) -> str:
        """A graph input fed with exactly `value`."""
        name = self.add_input(value.shape, value.dtype.type)
        self.feeds[name] = value
        return name

    def add_constant(self, value: np.ndarray) -> str:
        name = self.fresh("c")
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        self.shapes[name] = np.asarray(value).shape
        return name

    def add_operand(self, draw, shape) -> str:
        """A second operand: a graph input or a weight, as hypothesis chooses."""
        return self.add_input(shape) if draw(st.booleans()) else self.add_constant(self.random_array(shape))

    def apply(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.fresh("v")
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        shape = self._inferred_shape(out)
        if shape is None or 0 in shape:
            reject()            # an empty or unknown result says nothing; draw another graph
        self.shapes[out] = shape
        return out

    def model(self, output: str) -> onnx.ModelProto:
        out_info = helper.make_tensor_value_info(output, ONNX_DTYPE[self.dtype], list(self.shapes[output]))
        graph = helper.make_graph(self.nodes, "fuzz", self.inputs, [out_info], self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        return model

    def _inferred_shape(self, name: str) -> tuple[int, ...] | None:
        graph = helper.make_graph(self.nodes, "partial", self.inputs, [], self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except onnx.shape_inference.InferenceError:
            return None
        for vi in inferred.graph.value_info:
            if vi.name == name:
                dims = vi.type.tensor_type.shape.dim
                if all(d.HasField("dim_value") for d in dims):
                    return tuple(d.dim_value for d in dims)
        return None


# -- one step of the chain per op family: (applies to this shape and dtype?, apply it) ----------------
FLOAT_UNARY = ["Relu", "Sigmoid", "Tanh", "Abs", "Neg", "Softsign", "Erf", "Exp"]
INT_UNARY = ["Abs", "Neg"]
BINARY = ["Add", "Sub", "Mul", "Max", "Min"]


def unary(draw, b: ChainBuilder, x: str) -> str:
    op = draw(st.sampled_from(FLOAT_UNARY if b.dtype == np.float32 else INT_UNARY))
    if op == "Exp":
        x = b.apply("Tanh", [x])        # keeps exp's argument in [-1, 1]: no overflow to compare
    return b.apply(op, [x])


def binary(draw, b: ChainBuilder, x: str) -> str:
    shape = b.shapes[x]
    # numpy broadcasting both ways: drop leading dims, turn dims into 1, or widen dims of 1.
    other = [draw(st.sampled_from([d, 1] if d != 1 else [1, 2, 3])) for d in shape]
    other = other[draw(st.integers(0, len(other))):]
    y = b.add_operand(draw, other)
    a, c = (x, y) if draw(st.booleans()) else (y, x)
    return b.apply(draw(st.sampled_from(BINARY)), [a, c])


def divide(draw, b: ChainBuilder, x: str) -> str:
    """Div and Mod by a fresh operand kept away from zero (integer Div truncates, Mod has two sign
    conventions: the places backends get wrong)."""
    shape = b.shapes[x]
    other = [draw(st.sampled_from([d, 1])) for d in shape][draw(st.integers(0, len(shape))):]
    magnitude = b.random_array(other)
    sign = np.where(b.rng.random(other) < 0.5, -1, 1)
    divisor = np.asarray((np.abs(magnitude) + (1 if b.dtype != np.float32 else 0.5)) * sign, b.dtype)
    y = b.add_input_value(divisor) if draw(st.booleans()) else b.add_constant(divisor)
    if b.dtype == np.float32:
        op, attrs = draw(st.sampled_from([("Div", {}), ("Mod", {"fmod": 1})]))
    else:
        op, attrs = draw(st.sampled_from([("Div", {}), ("Mod", {"fmod": 0}), ("Mod", {"fmod": 1})]))
    return b.apply(op, [x, y], **attrs)


def matmul(draw, b: ChainBuilder, x: str) -> str:
    shape = b.shapes[x]
    n = draw(st.integers(1, 6))
    batch = [draw(st.sampled_from([d, 1])) for d in shape[:-2]][draw(st.integers(0, max(len(shape) - 2, 0))):]
    w = b.add_operand(draw, [*batch, shape[-1], n])
    return b.apply("MatMul", [x, w])


def gemm(draw, b: ChainBuilder, x: str) -> str:
    shape = b.shapes[x]
    if len(shape) != 2:
        x = b.apply("Reshape", [x, b.add_constant(np.array([-1, shape[-1]], np.int64))])
    m, k = b.shapes[x]
    n = draw(st.integers(1, 6))
    trans_a, trans_b = draw(st.booleans()), draw(st.booleans())
    if trans_a:
        x = b.apply("Transpose", [x])   # Gemm transposes it back: A stays (m, k)
    w = b.add_operand(draw, [n, k] if trans_b else [k, n])
    inputs = [x, w]
    bias = draw(st.sampled_from([None, (n,), (1, n), (m, n), (m, 1)]))
    if bias is not None:
        inputs.append(b.add_operand(draw, bias))
    return b.apply("Gemm", inputs, transA=int(trans_a), transB=int(trans_b),
                   alpha=draw(st.sampled_from([1.0, 0.5])), beta=draw(st.sampled_from([1.0, 2.0])))


def conv(draw, b: ChainBuilder, x: str) -> str:
    n, c, h, w = b.shapes[x]
    depthwise = c > 1 and draw(st.booleans())
    m = c if depthwise else draw(st.integers(1, 4))
    kh, kw = draw(st.integers(1, min(3, h))), draw(st.integers(1, min(3, w)))
    weight = b.add_constant(b.random_array([m, 1 if depthwise else c, kh, kw]))
    inputs = [x, weight] + ([b.add_constant(b.random_array([m]))] if draw(st.booleans()) else [])
    return b.apply("Conv", inputs, group=c if depthwise else 1, kernel_shape=[kh, kw],
                   strides=[draw(st.integers(1, 2)), draw(st.integers(1, 2))],
                   pads=[draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1)),
                         draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1))])


def pool(draw, b: ChainBuilder, x: str) -> str:
    _, _, h, w = b.shapes[x]
    op = draw(st.sampled_from(["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"]))
    if op.startswith("Global"):
        return b.apply(op, [x])
    kh, kw = draw(st.integers(1, min(3, h))), draw(st.integers(1, min(3, w)))
    attrs = dict(kernel_shape=[kh, kw], strides=[draw(st.integers(1, 2)), draw(st.integers(1, 2))],
                 pads=[draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1)),
                       draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1))])
    if op == "AveragePool":
        attrs["count_include_pad"] = int(draw(st.booleans()))
    return b.apply(op, [x], **attrs)


def reduce(draw, b: ChainBuilder, x: str) -> str:
    rank = len(b.shapes[x])
    ops = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"] if b.dtype == np.float32 else \
        ["ReduceSum", "ReduceMax", "ReduceMin"]
    axes = draw(st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank, unique_by=lambda a: a % rank))
    return b.apply(draw(st.sampled_from(ops)), [x, b.add_constant(np.array(axes, np.int64))],
                   keepdims=int(draw(st.booleans())))


def softmax(draw, b: ChainBuilder, x: str) -> str:
    rank = len(b.shapes[x])
    return b.apply(draw(st.sampled_from(["Softmax", "LogSoftmax"])), [x], axis=draw(st.integers(-rank, rank - 1)))


def transpose(draw, b: ChainBuilder, x: str) -> str:
    return b.apply("Transpose", [x], perm=draw(st.permutations(range(len(b.shapes[x])))))


def reshape(draw, b: ChainBuilder, x: str) -> str:
    shape = list(b.shapes[x])
    cut = draw(st.integers(0, len(shape)))
    target = [int(np.prod(shape[:cut], dtype=np.int64)), -1] if draw(st.booleans()) else [-1]
    if draw(st.booleans()) and len(shape) >= 2:
        target = [0, -1]                # 0 copies the input's dim
    return b.apply("Reshape", [x, b.add_constant(np.array(target, np.int64))])


def concat(draw, b: ChainBuilder, x: str) -> str:
    shape = list(b.shapes[x])
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    other = list(shape)
    other[axis] = draw(st.integers(1, 3))
    y = b.add_operand(draw, other)
    return b.apply("Concat", [x, y] if draw(st.booleans()) else [y, x], axis=axis)


def slice_(draw, b: ChainBuilder, x: str) -> str:
    shape = b.shapes[x]
    axes = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    starts, ends, steps = [], [], []
    for axis in axes:
        d = shape[axis]
        step = draw(st.sampled_from([1, 1, 2, -1]))
        start, end = draw(st.integers(-d - 1, d + 1)), draw(st.integers(-d - 2, d + 2))
        starts.append(start)
        ends.append(end)
        steps.append(step)
    constants = [b.add_constant(np.array(v, np.int64)) for v in (starts, ends, axes, steps)]
    return b.apply("Slice", [x, *constants])


def gather(draw, b: ChainBuilder, x: str) -> str:
    shape = b.shapes[x]
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    d = shape[axis]
    index_shape = draw(st.sampled_from([(), (2,), (2, 2), (3,), (1,)]))
    indices = b.rng.integers(-d, d, size=index_shape).astype(np.int64)
    return b.apply("Gather", [x, b.add_constant(indices)], axis=axis)


@dataclass(frozen=True)
class Family:
    name: str
    steps: tuple
    dtypes: tuple
    ranks: tuple[int, int]        # the input's rank range
    first: object = None          # a step every graph of the family starts with

    def __str__(self) -> str:
        return self.name


LAYOUT = (transpose, reshape, concat, slice_, gather)
FAMILIES = [
    Family("elementwise-layout-float", (unary, binary, divide, reduce, softmax, *LAYOUT), (np.float32,), (1, 4)),
    Family("elementwise-layout-int", (unary, binary, divide, reduce, *LAYOUT), (np.int32, np.int64), (1, 4)),
    Family("contraction", (matmul, gemm, unary, binary, softmax), (np.float32,), (1, 3), first=matmul),
    Family("conv-pool", (conv, pool, unary, binary), (np.float32,), (4, 4), first=conv),
]


@st.composite
def random_graphs(draw, family: Family):
    dtype = draw(st.sampled_from(family.dtypes))
    b = ChainBuilder(dtype, np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
    rank = draw(st.integers(*family.ranks))
    shape = [draw(st.integers(1, 5)) for _ in range(rank)]
    x = b.add_input(shape)
    steps = [family.first] if family.first else []
    steps += draw(st.lists(st.sampled_from(family.steps), min_size=1, max_size=4))
    for step in steps:
        if step in (conv, pool) and len(b.shapes[x]) != 4:
            continue                    # only rank-4 values are images
        if len(b.shapes[x]) == 0 and step not in (unary, binary):
            continue                    # a full reduction left a scalar: only elementwise ops apply
        x = step(draw, b, x)
    return b.model(x), b.feeds


def run_onnxruntime(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def run_cortex_everywhere(model: onnx.ModelProto, feeds: dict):
    """Decompose and build the DAG once, then compile and run at every opt level and feature set;
    yields (features, opt level, output)."""
    defaults = PartitionIntoCUs()
    with tempfile.TemporaryDirectory(prefix="cortex-fuzz-") as tmp:
        tmp = Path(tmp)
        onnx.save(model, tmp / "model.onnx")
        decompose_model(tmp / "model.onnx", tmp / "cus", defaults)
        for features in FEATURE_SETS:
            for level in OPT_LEVELS:
                build = tmp / f"build-{features or 'none'}-{level}"
                dag_path = build / "dag.json"
                build.mkdir()
                write_bytes_atomically(dag_path, json.dumps(build_dag(tmp / "cus", dag_path)).encode())
                compile_cu_dir(target("wasm"), tmp / "cus", build / "wasm-bin", parse_options(None, features, level), dag_path)
                outputs = load(dag_path, "wasm").run(feeds)
                yield features, level, outputs[model.graph.output[0].name]


def check_against_onnxruntime(model: onnx.ModelProto, feeds: dict) -> None:
    expected = run_onnxruntime(model, feeds)
    for features, level, got in run_cortex_everywhere(model, feeds):
        where = f"--features {features or '(none)'} --opt-level {level}"
        assert got.dtype == expected.dtype and got.shape == expected.shape, \
            f"{where}: got {got.dtype}{list(got.shape)}, onnxruntime {expected.dtype}{list(expected.shape)}"
        if expected.dtype.kind == "f":
            np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=where)
        else:
            np.testing.assert_array_equal(got, expected, err_msg=where)


@pytest.mark.parametrize("family", FAMILIES, ids=str)
@DEFAULT_RUN
@given(data=st.data())
def test_random_graphs_match_onnxruntime_at_every_opt_level_and_feature_set(family, data):
    model, feeds = data.draw(random_graphs(family), label="graph")
    note(onnx.printer.to_text(model))
    check_against_onnxruntime(model, feeds)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES, ids=str)
@LONG_RUN
@given(data=st.data())
def test_many_random_graphs_match_onnxruntime(family, data):
    model, feeds = data.draw(random_graphs(family), label="graph")
    note(onnx.printer.to_text(model))
    check_against_onnxruntime(model, feeds)


# -- bugs this test found, kept as exact reproductions ---------------------------------------------------
def gather_model(indices: np.ndarray, x_shape=(3, 3)) -> tuple[onnx.ModelProto, dict]:
    b = ChainBuilder(np.float32, np.random.default_rng(0))
    x = b.add_input(list(x_shape))
    return b.model(b.apply("Gather", [x, b.add_constant(indices)], axis=0)), b.feeds


def test_gather_with_constant_scalar_indices():
    # Found by the fuzz test: the scalar weight reached the Gather lowering as a rank-1 buffer and
    # compilation failed with a raw ValueError.
    check_against_onnxruntime(*gather_model(np.array(1, np.int64)))


def test_gather_with_constant_one_element_indices():
    check_against_onnxruntime(*gather_model(np.array([1], np.int64)))
